"""Counter-based random numbers for the sequence data: SplitMix64 (apps.core.common.hashing) of
(key, counter), so every number is a pure function of where it is used (seed, split, user,
event, stream) and the same on any device and in any order of generation."""

import math

import torch

from apps.core.common.hashing import GOLDEN_GAMMA, mix64, mix64_int, shift_right, signed


def key(*parts: int) -> int:
    """One 64-bit key of the integers ``parts`` (seed, split, block, ...), each mixed in turn."""
    value = 0
    for part in parts:
        value = mix64_int(value + part)
    return value


def bits(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Random int64 bits for each (key, counter), broadcast."""
    return mix64(mix64(keys) + counters * signed(GOLDEN_GAMMA))


def below(random_bits: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """Integers uniform in [0, n) from the top 53 bits (the bias of the modulo is below 2**-40
    for any n under 2**13 ... 2**40 items)."""
    return shift_right(random_bits, 11) % n


def uniform(random_bits: torch.Tensor) -> torch.Tensor:
    """Floats in (0, 1), float64."""
    return (shift_right(random_bits, 11).double() + 0.5) / float(1 << 53)


def normal(random_bits: torch.Tensor) -> torch.Tensor:
    """A standard normal float64 per value, by Box-Muller from its two 26-bit halves."""
    u1 = (shift_right(random_bits, 38).double() + 0.5) / float(1 << 26)
    u2 = ((random_bits & ((1 << 26) - 1)).double() + 0.5) / float(1 << 26)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
