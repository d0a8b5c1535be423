"""The layout of the KeyedJaggedTensors whose features have a fixed number of ids per sample."""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.kjt import sized_kjt


class FixedLayout:
    """Batches of ``size`` samples with ``ids_per_feature[f]`` ids of feature ``keys[f]`` each:
    their lengths, offsets and ids per key, made once for every batch of the size, so that no
    batch's KJT reads them back from the device (:func:`sized_kjt`)."""

    def __init__(self, keys: list[str], ids_per_feature: list[int], size: int, device: torch.device | None = None):
        self.keys, self.size = keys, size
        self.per_key = [size * m for m in ids_per_feature]
        self.lengths = torch.tensor(ids_per_feature, dtype=torch.int32, device=device).repeat_interleave(size)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.offsets = torch.cat([zero, self.lengths.cumsum(0, dtype=torch.int32)])

    def kjt(self, values: torch.Tensor) -> KeyedJaggedTensor:
        """The batch's KJT of ``values`` (feature-major)."""
        return sized_kjt(self.keys, values, self.lengths, self.per_key, self.size, self.offsets)
