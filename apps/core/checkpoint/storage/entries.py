"""Loading one entry of a shard file into the tensor (or value) it loads into.

A plain tensor is read straight into its target (:mod:`apps.core.checkpoint.storage.stored_tensor`
finds its bytes); any other entry loads with ``torch.load(weights_only=True)``, which runs
nothing that the entry pickled. Both readers load every entry through here.
"""

import io
import pickle
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from apps.core.checkpoint.storage.errors import CheckpointError, DamagedCheckpoint
from apps.core.checkpoint.storage.sources import Source
from apps.core.checkpoint.storage.stored_tensor import stored_tensor


class EntryView(io.RawIOBase):
    """One entry of a shard file as a file of its own: the ``info.length`` bytes at
    ``info.offset`` of the shard file, read from ``source``. Reads never leave the entry (but to
    check the blocks they lie in): a damaged one cannot spill into its neighbours."""

    def __init__(self, source: Source, info: _StorageInfo) -> None:
        super().__init__()
        self.source, self.info = source, info
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (0, self.pos, self.info.length)[whence]
        return self.pos

    def readinto(self, buffer: Any) -> int:
        left = max(0, self.info.length - self.pos)
        with memoryview(buffer) as view, view.cast("B") as raw, raw[:left] as wanted:
            got = self.source.readinto(self.info.offset + self.pos, wanted)
        self.pos += got
        return got

    def fill(self, offset: int, tensor: torch.Tensor) -> torch.Tensor:
        """Reads the entry's bytes from ``offset`` into the contiguous CPU ``tensor``; returns it."""
        with tensor.view(-1).view(torch.uint8).numpy().data as buffer:
            self.seek(offset)
            filled = 0
            while filled < len(buffer):
                got = self.readinto(buffer[filled:])
                if not got:
                    raise DamagedCheckpoint(
                        f"shard file {self.info.relative_path} ends inside its entry at byte {self.info.offset}: it is truncated"
                    )
                filled += got
        return tensor


def load_item(entry: EntryView, req: ReadItem, planner: LoadPlanner) -> None:
    """Loads the piece ``req`` of ``entry`` through ``planner``, as DCP's reader does."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(entry.read()))
        return
    target = planner.resolve_tensor(req).detach()
    source = _read_tensor(entry, req, target)
    if source.shape != target.shape:
        raise DamagedCheckpoint(
            f"checkpoint entry {req.storage_index.fqn} holds a {tuple(source.shape)} piece where its "
            f".metadata says {tuple(target.shape)}"
        )
    if source is not target:
        target.copy_(source)
    planner.commit_tensor(req, target)


def _read_tensor(entry: EntryView, req: ReadItem, target: torch.Tensor) -> torch.Tensor:
    """The piece ``req`` of the tensor in ``entry``, read straight into ``target`` where the
    piece lies in one run of bytes and ``target`` is a contiguous CPU tensor of its dtype (the
    common case, which needs no copy beyond the read); else read into a new CPU tensor.

    DCP's reader ``torch.load``s every entry into a new tensor and copies that into the target.
    Profiled on one rank of a 1 GB load (2 ranks, page cache dropped): 1.34-1.46 s that way,
    0.9 s of it reading into fresh memory and 0.2-0.3 s copying; 0.74 s this way, all reading.
    """
    stored = stored_tensor(entry, entry.info.length)
    if stored is None:  # not a plain tensor: torch's own loader, as DCP reads it
        entry.seek(0)
        return narrow_tensor_by_index(load_plain_data(entry, req.storage_index.fqn), req.storage_offsets, req.lengths)
    piece = narrow_tensor_by_index(stored.layout, req.storage_offsets, req.lengths)
    if not piece.is_contiguous():  # strewn through the storage (a column slice): read it all
        storage = entry.fill(stored.start, torch.empty(stored.numel, dtype=piece.dtype))
        return storage.as_strided(piece.shape, piece.stride(), piece.storage_offset())
    in_place = (
        target.device.type == "cpu"
        and target.is_contiguous()
        and (target.dtype, target.shape) == (piece.dtype, piece.shape)
    )
    into = target if in_place else torch.empty(piece.shape, dtype=piece.dtype)
    return entry.fill(stored.start + int(piece.storage_offset()) * piece.element_size(), into)


def load_plain_data(entry: Any, fqn: str) -> Any:
    """``torch.load(weights_only=True)`` of the checkpoint entry of ``fqn``, on the CPU: refuses,
    having run nothing, an entry that pickles anything but plain data and tensors."""
    try:
        return torch.load(entry, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint entry {fqn} holds a pickled object, not plain data: it was not loaded. "
            "Someone else may have written into --checkpoint_dir: use a --checkpoint_dir only you "
            "can write to"
        ) from None
    except DamagedCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - anything else torch.load raises means the same: unreadable
        raise DamagedCheckpoint(f"checkpoint entry {fqn} cannot be read ({type(e).__name__}: {e})") from None
