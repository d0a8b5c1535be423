"""Moving whole tensors in and out of a sharded model's state, for tests that compare them."""

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from benchmarks.equivalence import shard_pieces


def flat_state(state: dict) -> dict:
    """A DCP-style state (stateful parts expanded) flattened to dotted keys, as DCP saves it."""
    expanded = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    flat, _ = flatten_state_dict(expanded)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def local_pieces(state: dict) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    return {name: [(o, t.detach().clone()) for o, t in shard_pieces(v)] for name, v in flat_state(state).items()}


def assemble(pieces_of_ranks: list[dict], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The whole tensor ``name`` put together from the pieces every rank held (by default as
    large as they reach)."""
    placed = [(offsets, tensor) for pieces in pieces_of_ranks for offsets, tensor in pieces.get(name, [])]
    if shape is None:
        shape = tuple(
            max(sizes) for sizes in zip(*([o + n for o, n in zip(offsets, tensor.shape)] for offsets, tensor in placed))
        )
    full = torch.full(shape, float("nan"), dtype=torch.float32)
    for offsets, tensor in placed:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
        full[index] = tensor.float()
    return full


def saved_tensors(step_dir: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors straight from a checkpoint (by default all of them), read in one process."""
    metadata = FsspecReader(step_dir).read_metadata().state_dict_metadata
    state = {
        name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for name, md in metadata.items()
        if isinstance(md, TensorStorageMetadata) and (names is None or name in names)
    }
    with warnings.catch_warnings():  # that one process is no process group: as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FsspecReader(step_dir), no_dist=True)
    return state


def sharded(full: torch.Tensor, pieces: list[tuple[int, int, int, int]]):
    """A sharded tensor of ``full``'s values, its pieces (rows r0:r1, columns c0:c1) all on this rank."""
    shards = [
        Shard(full[r0:r1, c0:c1].clone(), ShardMetadata([r0, c0], [r1 - r0, c1 - c0], "rank:0/cpu"))
        for r0, r1, c0, c1 in pieces
    ]
    return init_from_local_shards(shards, *full.shape)


def whole(tensor) -> torch.Tensor:
    out = torch.zeros(tensor.size())
    for shard in tensor.local_shards():
        (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        out[r : r + h, c : c + w] = shard.tensor
    return out
