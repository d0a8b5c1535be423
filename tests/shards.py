"""Moving whole tensors in and out of a sharded model's state, for tests that compare them."""

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.stateful import Stateful


def _pieces(tensor):
    """(offsets, local tensor) of every piece of ``tensor`` this rank holds."""
    if isinstance(tensor, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in tensor.local_shards()]
    return [((0,) * tensor.dim(), tensor)]


def flat_state(state: dict) -> dict:
    """A DCP-style state (stateful parts expanded) flattened to dotted keys, as DCP saves it."""
    expanded = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    flat, _ = flatten_state_dict(expanded)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def local_pieces(state: dict) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    return {name: [(o, t.detach().clone()) for o, t in _pieces(v)] for name, v in flat_state(state).items()}


def assemble(pieces_of_ranks: list[dict], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor ``name`` put together from the pieces every rank held."""
    full = torch.full(shape, float("nan"), dtype=torch.float32)
    for pieces in pieces_of_ranks:
        for offsets, tensor in pieces.get(name, []):
            index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            full[index] = tensor.float()
    return full


def copy_into(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies whole (unsharded) weights into the pieces of the model this rank holds."""
    state = model.state_dict()
    assert set(state) == set(full), sorted(set(state) ^ set(full))
    with torch.no_grad():
        for name, tensor in state.items():
            for offsets, piece in _pieces(tensor):
                index = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                piece.copy_(full[name][index])
