"""SplitMix64, the counter-based hash behind every pseudo-random number of the synthetic click logs
(:mod:`apps.dlrm.data.synthetic`) and the ``hash`` ids of Parquet columns
(:mod:`apps.dlrm.data.parquet.read`) and of ``zch`` ids (:func:`hashed_ids`): pure 64-bit integer
arithmetic on int64 tensors, so it gives the same bits on a CPU and on a GPU.
"""

from typing import Callable

import numpy as np
import pyarrow as pa
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


def id_values(values: pa.Array) -> np.ndarray:
    """The integers of an id column without nulls; of a text column, its values' fingerprints."""
    if pa.types.is_integer(values.type):
        return values.to_numpy()
    return text_fingerprints(values)


FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def text_fingerprints(texts: pa.Array) -> np.ndarray:
    """uint64 [n]: FNV-1a 64 of each value's bytes (a string's UTF-8), ``texts`` holding no null:
    a 64-bit integer per text that ``hash`` ids then mix as they mix integers. Vectorised over the
    values, one pass per byte position over the values that long, kept first by sorting them by
    length (so each pass works on a prefix, in place)."""
    texts = texts.cast(pa.large_binary())  # one offset width; a string's bytes are its UTF-8
    _, offset_buffer, data_buffer = texts.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=np.int64)[texts.offset : texts.offset + len(texts) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    hashes = np.full(len(texts), FNV_OFFSET_BASIS, dtype=np.uint64)
    if not len(texts):
        return hashes
    if lengths.min() == lengths.max():  # one width (hex ids, codes): the bytes are a matrix, in order
        width = int(lengths[0])
        matrix = data[offsets[0] : offsets[0] + width * len(texts)].reshape(len(texts), width)
        return _fnv1a_passes(hashes, lambda position, count: matrix[:, position], np.full(width, len(texts)))
    by_length = np.argsort(-lengths, kind="stable")
    longest_first, starts = lengths[by_length], offsets[:-1][by_length]
    # per position, the values longer than it: a prefix of the values sorted by length
    counts = np.searchsorted(-longest_first, -np.arange(longest_first[0]), side="left")
    _fnv1a_passes(hashes, lambda position, count: data[starts[:count] + position], counts)
    fingerprints = np.empty_like(hashes)
    fingerprints[by_length] = hashes
    return fingerprints


def _fnv1a_passes(hashes: np.ndarray, byte_at: Callable[[int, int], np.ndarray], counts: np.ndarray) -> np.ndarray:
    """FNV-1a's step for each byte position p, in place, on the first ``counts[p]`` hashes, whose
    bytes at p ``byte_at(p, counts[p])`` gives."""
    prime = np.uint64(FNV_PRIME)
    for position, count in enumerate(counts.tolist()):
        active = hashes[:count]
        active ^= byte_at(position, count)
        active *= prime
    return hashes
