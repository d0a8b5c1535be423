"""Moving whole tensors in and out of a sharded model's state, for tests that compare them."""

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from benchmarks.equivalence import shard_pieces


def flat_state(state: dict) -> dict:
    """A DCP-style state (stateful parts expanded) flattened to dotted keys, as DCP saves it."""
    expanded = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    flat, _ = flatten_state_dict(expanded)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def local_pieces(state: dict) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    return {name: [(o, t.detach().clone()) for o, t in shard_pieces(v)] for name, v in flat_state(state).items()}


def assemble(pieces_of_ranks: list[dict], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor ``name`` put together from the pieces every rank held."""
    full = torch.full(shape, float("nan"), dtype=torch.float32)
    for pieces in pieces_of_ranks:
        for offsets, tensor in pieces.get(name, []):
            index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            full[index] = tensor.float()
    return full
