"""KeyedJaggedTensors told the sizes their data source knows."""

import itertools

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def sized_kjt(
    keys: list[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    per_key: list[int],
    stride: int,
    offsets: torch.Tensor | None = None,
) -> KeyedJaggedTensor:
    """The KJT of ``keys`` with ``stride`` samples, ``per_key[k]`` ids of ``keys[k]``: what its
    source knows without reading ``lengths`` (a batch's shapes, its files' metadata), which the
    KJT would otherwise read back from the device, a host sync each, when TorchRec's input
    distribution splits it among the lookups and sends it."""
    return KeyedJaggedTensor(
        keys=keys,
        values=values,
        lengths=lengths,
        offsets=offsets,
        stride=stride,
        length_per_key=per_key,
        offset_per_key=[0, *itertools.accumulate(per_key)],
        index_per_key={key: k for k, key in enumerate(keys)},
    )
