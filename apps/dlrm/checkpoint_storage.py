"""How checkpoint shards are written and read: DCP with storage that runs no code from the files.

:mod:`apps.dlrm.checkpoint` decides what is saved, where, and when it counts; this module moves
the bytes. Every rank writes its own shards and ``.metadata`` (a pickle, written by rank 0)
says where each tensor's pieces are; loading reads only the pieces a rank holds under its
current sharding, which is how DCP reshards.

Nothing read here runs code: ``.metadata`` is read by an unpickler that builds DCP's metadata
types and nothing else, and tensors and byte entries load with ``torch.load(weights_only=True)``.
"""

import io
import pickle
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.futures import Future

from apps.dlrm.options import ConfigError
from apps.dlrm.urls import redact_urls

# Bytes fetched per round trip when loading: bounds the memory a load needs beyond the model.
_READ_BATCH_BYTES = 512 * 2**20


class CheckpointError(ConfigError):
    """A checkpoint location or checkpoint cannot be used; the message says why and what to do."""


# What DCP's .metadata is made of: its dataclasses, the file system reader's storage info,
# torch.Size, dtypes (as torch.<name>) and the layout rebuilder: the globals of a real
# checkpoint of this app under torch 2.13, all in DCP's metadata since before torch 2.11.
_METADATA_GLOBALS = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        torch.serialization._get_layout,
    )
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing any other global (``os.system``, ``builtins.eval``...).

    A pickle runs code only through the globals it loads; these build plain data, so a
    ``.metadata`` planted in a shared --checkpoint_dir cannot run anything here.
    """

    def __init__(self, file, url: str) -> None:
        super().__init__(file)
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{redact_urls(self.url)} would load {module}.{name}, which is not part of DCP "
            "checkpoint metadata: refused unread, nothing in it ran. Someone else may have written "
            "into --checkpoint_dir: delete that step folder, or use a folder only you can write to"
        )


class CheckpointReader(FsspecReader):
    """DCP's fsspec reader, reading ``.metadata`` with :class:`_MetadataUnpickler` instead of
    ``pickle.load``. Every read of our checkpoints goes through it (and its subclass)."""

    def read_metadata(self) -> dcp_metadata.Metadata:
        # No **kwargs: DCP then never falls back to per-rank metadata files, which we never write.
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(
                f"{redact_urls(str(path))} holds a {type(metadata).__name__}, not DCP metadata"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _CheckpointWriter(FsspecWriter):
    """DCP's fsspec writer, recording the checkpoint's URL in ``.metadata`` without credentials."""

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = redact_urls(str(meta.checkpoint_id))
        return meta


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte entries (non-tensor values) load with
    ``torch.load(weights_only=True)``: DCP's own ``weights_only=False`` would run whatever a
    planted shard file pickled. Our checkpoints hold tensors only; plain data still loads."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn} holds a pickled object, not plain "
                "data: it was not loaded. Someone else may have written into --checkpoint_dir: use a "
                "--checkpoint_dir only you can write to"
            ) from None
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


class BatchedFsspecReader(CheckpointReader):
    """DCP's fsspec reader, fetching the byte ranges of many tensors in one request.

    DCP's own reader hands ``torch.load`` a view of the remote file, whose many small reads and
    seeks each become a request to the object store (over 3x slower than reading the same
    bytes here on S3). This one fetches up to ``_READ_BATCH_BYTES`` of ranges at once with
    fsspec's ``cat_ranges`` (concurrent on object stores) and deserialises from memory.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
        if any(info.transform_descriptors for _, info in items):
            return super().read_data(plan, planner)  # compressed/transformed: DCP's own path
        batch: list = []
        for item in items + [None]:
            if item is None or sum(info.length for _, info in batch) + item[1].length > _READ_BATCH_BYTES:
                self._load_batch(batch, planner)
                batch = []
            if item is not None:
                batch.append(item)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _load_batch(self, batch: list, planner: LoadPlanner) -> None:
        if not batch:
            return
        # DCP writes a rank's tensors back to back: adjacent ranges become one request.
        batch = sorted(batch, key=lambda item: (item[1].relative_path, item[1].offset))
        spans: list[list] = []  # [path, start, end, items]
        for item in batch:
            info = item[1]
            if spans and spans[-1][0] == info.relative_path and spans[-1][2] == info.offset:
                spans[-1][2] = info.offset + info.length
                spans[-1][3].append(item)
            else:
                spans.append([info.relative_path, info.offset, info.offset + info.length, [item]])
        blobs = self.fs.fs.cat_ranges(
            [self.fs.concat_path(self.path, path) for path, *_ in spans],
            [start for _, start, _, _ in spans],
            [end for _, _, end, _ in spans],
            on_error="raise",
        )
        for (_, start, _, items), blob in zip(spans, blobs):
            view = memoryview(blob)
            for req, info in items:
                data = io.BytesIO(view[info.offset - start : info.offset - start + info.length])
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, data)
                    continue
                tensor = torch.load(data, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                target.copy_(tensor)
                planner.commit_tensor(req, target)


def save_shards(state: dict[str, Any], url: str, local: bool) -> None:
    """Collective: every rank writes its shards of ``state`` under ``url``; returns once rank 0
    has written ``.metadata`` (so every rank's shards are complete). ``local`` files are
    fsync'ed: a checkpoint is committed only after its bytes are on disk."""
    dcp.save(state, storage_writer=_CheckpointWriter(url, sync_files=local))


class HostStager(BlockingAsyncStager):
    """Copies the state to host memory for :func:`save_shards_async`, into buffers made at the
    first save and reused by every later one: the copy is then all a background save costs
    training (DCP's own stager allocates, and deep-copies sharded tensors, at every save, or
    caches only pinned buffers, which CPU-only machines cannot make). ``pinned`` (GPU ranks)
    page-locks them, so the copy from the GPU runs at full speed. One save at a time may use it
    (the buffers are what the writer reads); close it after the last."""

    def __init__(self, pinned: bool) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._pinned = pinned

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self._pinned)
        return _copy_state_dict(state_dict, self.state_dict_cache)


def save_shards_async(state: dict[str, Any], url: str, local: bool, group: dist.ProcessGroup,
                      stager: HostStager) -> ConcurrentFuture:
    """Collective: copies this rank's shards of ``state`` to host memory with ``stager`` now,
    then writes them in a background thread that coordinates over ``group``. The future
    completes once rank 0 wrote ``.metadata``: every rank's shards are then complete. ``group``
    must be a gloo group that nothing else uses, since its collectives run in that thread while
    training uses the default group."""
    writer = _CheckpointWriter(url, sync_files=local)
    return dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)


def load_shards(state: dict[str, Any], url: str, local: bool) -> None:
    """Collective: every rank reads into ``state`` the pieces it holds under its current sharding."""
    # A local file is read fastest by DCP itself (torch.load straight from the file).
    reader = CheckpointReader(url) if local else BatchedFsspecReader(url)
    dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner())
