"""Reading a checkpoint's ``.metadata``: unpickled building DCP's metadata types and nothing
else, and checked to add up before a load trusts it.

``.metadata`` (a pickle, written by rank 0) says where every tensor's pieces are: a planted one
must run nothing, and a damaged one must be refused before DCP reads through it (a negative
offset raises a traceback; pieces that do not tile a tensor would load part of it).
"""

import math
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from apps.core.checkpoint.storage.errors import CheckpointError, DamagedCheckpoint
from apps.core.checkpoint.storage.unpickling import RestrictedUnpickler
from apps.core.urls import redact_urls

# What DCP's .metadata is made of: its dataclasses, the file system reader's storage info,
# torch.Size, dtypes (as torch.<name>) and the layout rebuilder: the globals of a real
# checkpoint of this app under torch 2.13, all in DCP's metadata since before torch 2.11.
_METADATA_CLASSES = (
    dcp_metadata.Metadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties,
    _StorageInfo,
)
_METADATA_GLOBALS = {
    (item.__module__, item.__qualname__): item
    for item in (*_METADATA_CLASSES, dcp_metadata._MEM_FORMAT_ENCODING, torch.Size, torch.serialization._get_layout)
}


class _MetadataUnpickler(RestrictedUnpickler):
    """Unpickles DCP metadata, refusing any other global (``os.system``, ``builtins.eval``...).

    A pickle runs code only through the globals it loads; these build plain data, so a
    ``.metadata`` planted in a shared --checkpoint_dir cannot run anything here, nor change DCP's
    classes or objects (:class:`RestrictedUnpickler`).
    """

    buildable = _METADATA_CLASSES

    def __init__(self, file: IO[bytes], url: str) -> None:
        super().__init__(file)
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise self.refused(f"load {module}.{name}, which is not part of DCP checkpoint metadata")

    def refused(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{redact_urls(self.url)} would {what}: refused unread, nothing in it ran. Someone else "
            "may have written into --checkpoint_dir: delete that step folder, or use a folder only you "
            "can write to"
        )


def read_metadata_file(file: IO[bytes], url: str) -> dcp_metadata.Metadata:
    """The DCP metadata that ``file``, the ``.metadata`` at ``url``, holds; raises
    :class:`CheckpointError` where it would load anything else, :class:`DamagedCheckpoint` where
    it does not add up."""
    metadata = _MetadataUnpickler(file, url).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{redact_urls(url)} holds a {type(metadata).__name__}, not DCP metadata")
    problem = _metadata_problem(metadata)
    if problem:
        raise DamagedCheckpoint(f"{redact_urls(url)}: {problem}")
    return metadata


def _metadata_problem(metadata: dcp_metadata.Metadata) -> str | None:
    """What in ``metadata`` does not add up, or None: an entry at a negative offset or of a negative
    length (DCP would raise a traceback reading it), a tensor whose pieces do not tile it (DCP would
    load the rest, leaving part of a table as it was), a piece or value without its entry."""
    storage = metadata.storage_data or {}
    for index, info in storage.items():
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"entry {index.fqn} has a negative offset or length ({info.offset}, {info.length})"
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            if dcp_metadata.MetadataIndex(fqn) not in storage:
                return f"{fqn} has no entry"
            continue
        if not _tiles(tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]):
            pieces = ", ".join(f"{tuple(c.sizes)} at {tuple(c.offsets)}" for c in md.chunks)
            return f"tensor {fqn} of size {tuple(md.size)} has pieces that do not tile it: {pieces}"
        for chunk in md.chunks:
            if dcp_metadata.MetadataIndex(fqn, chunk.offsets) not in storage:
                return f"tensor {fqn} has no entry for its piece at {tuple(chunk.offsets)}"
    return None


def _tiles(size: tuple[int, ...], pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether ``pieces`` ((offsets, sizes) each) tile a tensor of ``size``: every one inside it, as
    many elements as it has in all, and no two overlapping (which, with the count, leaves no gap)."""
    boxes = []
    for offsets, sizes in pieces:
        if not len(offsets) == len(sizes) == len(size):
            return False
        if any(o < 0 or n < 0 or o + n > whole for o, n, whole in zip(offsets, sizes, size)):
            return False
        boxes.append((offsets, tuple(o + n for o, n in zip(offsets, sizes))))
    if sum(math.prod(e - s for s, e in zip(*box)) for box in boxes) != math.prod(size):
        return False
    return not _overlap(boxes)


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of ``boxes`` ((start, end) corners) share an element. Swept along the first
    dimension: each box is compared with those it meets there only (none but its neighbours where a
    tensor is cut into rows, which keeps the check linear for the row-wise pieces of many ranks)."""
    met: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for start, end in sorted(boxes):
        met = [box for box in met if box[1][0] > start[0]]
        if any(all(max(a, b) < min(c, d) for a, c, b, d in zip(start, end, *box)) for box in met):
            return True
        met.append((start, end))
    return False
