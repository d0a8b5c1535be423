"""The layout of a KeyedJaggedTensor whose features have a fixed number of ids per sample."""

import itertools
from typing import Any

import torch


def fixed_layout(keys: list[str], ids_per_feature: list[int], size: int, device: torch.device | None = None) -> dict:
    """``KeyedJaggedTensor`` keyword arguments (all but ``keys`` and ``values``) for ``size``
    samples with ``ids_per_feature[f]`` ids of feature ``keys[f]`` each: lengths, offsets and
    every per-key figure the KJT would otherwise compute from them.

    Computed once per batch size (the same for every batch of it), they spare each batch the
    host syncs TorchRec's input distribution pays for a KJT that knows only its lengths
    (``.tolist()`` of the lengths per key, of the offsets and of the stride) before splitting it
    among the lookups and sending it.
    """
    per_key = [size * m for m in ids_per_feature]
    lengths = torch.tensor(ids_per_feature, dtype=torch.int32, device=device).repeat_interleave(size)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    layout: dict[str, Any] = dict(
        lengths=lengths,
        offsets=torch.cat([zero, lengths.cumsum(0, dtype=torch.int32)]),
        stride=size,
        length_per_key=per_key,
        offset_per_key=[0, *itertools.accumulate(per_key)],
        index_per_key={key: f for f, key in enumerate(keys)},
    )
    return layout
