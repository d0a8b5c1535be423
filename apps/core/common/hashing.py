"""SplitMix64, the counter-based hash behind every pseudo-random number of the synthetic click logs
(:mod:`apps.dlrm.data.synthetic`) and the ``hash`` ids of Parquet columns
(:mod:`apps.dlrm.data.parquet.read`) and of ``zch`` ids (:func:`hashed_ids`): pure 64-bit integer
arithmetic on int64 tensors, so it gives the same bits on a CPU and on a GPU.
"""

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``: torch has no uint64 arithmetic."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors: a fast bijective hash of 64-bit values.

    Multiplications wrap around in two's complement, which gives the same bits as unsigned.
    """
    x = x + signed(GOLDEN_GAMMA)
    x = (x ^ shift_right(x, 30)) * signed(_MIX1)
    x = (x ^ shift_right(x, 27)) * signed(_MIX2)
    return x ^ shift_right(x, 31)


def mix64_int(value: int) -> int:
    """:func:`mix64` of one Python int, as an int64 value."""
    return int(mix64(torch.tensor([signed(value)], dtype=torch.int64))[0])


def hashed_ids(values: np.ndarray, size: int) -> np.ndarray:
    """uint64: :func:`mix64` of integer ids ``values`` (any integer type; uint64 ids keep their
    bits) modulo ``size``, unsigned: how raw ids become rows (``--categorical_ids hash``) or
    TorchRec's managed-collision input range (``zch``, :data:`apps.core.zch.config.INPUT_HASH_SIZE`)."""
    bits = values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64)
    return mix64(torch.from_numpy(bits)).numpy().view(np.uint64) % np.uint64(size)
