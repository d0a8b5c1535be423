"""MLPerf DLRMv2's multi-hot Criteo: several ids per sample per feature, derived from the one-hot id.

The Criteo click logs have one id per categorical feature. MLPerf's DLRMv2 benchmark (TorchRec's
``torchrec_dlrm`` example, ``multi_hot.py`` and ``scripts/materialize_synthetic_multihot_dataset.py``)
turns each into ``multi_hot_sizes[f]`` ids by a fixed lookup table per feature: row ``i`` of the
table of feature ``f`` is ``i`` itself followed by ``multi_hot_sizes[f] - 1`` ids drawn uniformly
from ``[0, rows_f)``. The tables are drawn once, feature after feature, from NumPy's legacy
generator seeded with 0, so every rank and every run derives the same ids. We draw them the same
way, which makes our multi-hot Criteo batches those of the MLPerf reference (tests/integration/test_multi_hot.py
checks ours against the reference's output on a sample).

The tables are held in memory by every training process, as in the reference: 4 bytes per id
per row, 22.3 GiB for MLPerf's table sizes and multi-hot sizes (:func:`table_bytes`), and drawing them takes a
while (one random number per extra id). They are drawn straight into int32, a few million ids at a
time, so that drawing takes hardly more memory than holding; and a host whose available memory
(or container limit) cannot hold them in all its training processes is refused before the first
draw, with the figures (:func:`check_host_memory`), instead of its processes being killed.
"""

import numpy as np

from apps.core.common.errors import ConfigError

#: The seed of the reference's ``np.random.seed(0)``: the same tables on every rank.
MLPERF_SEED = 0


#: Ids drawn at a time (16 MiB of int32): the draw's temporary beside the tables.
DRAW_IDS = 1 << 22

#: This container's memory limit, usage and reclaimable page cache (a key of memory.stat): cgroup
#: v2, then v1. Where there is a limit, it is what the kernel kills processes at, not the host's.
_CGROUPS = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def multi_hot_tables(multi_hot_sizes: list[int], table_sizes: list[int]) -> list[np.ndarray]:
    """One int32 lookup table [rows_f, multi_hot_sizes[f]] per feature, drawn as MLPerf draws them.

    Column 0 is the one-hot id itself; the other columns are uniform in ``[0, rows_f)``. The draws
    of every feature, one-hot ones included, come from one generator in feature order: the
    tables of later features depend on the sizes of earlier ones, as in the reference. They are
    drawn as int32, ``DRAW_IDS`` at a time, into the table: the legacy generator draws ids below
    2**31 alike as int32 or int64, one after another, so these are the reference's ids.
    """
    generator = np.random.RandomState(MLPERF_SEED)
    tables = []
    for rows, size in zip(table_sizes, multi_hot_sizes):
        table = np.empty((rows, size), np.int32)
        table[:, 0] = np.arange(rows, dtype=np.int32)
        _draw_into(table[:, 1:], generator)
        tables.append(table)
    return tables


def _draw_into(out: np.ndarray, generator: np.random.RandomState) -> None:
    """Fills ``out`` [rows, k] with ids uniform in ``[0, rows)``, row after row, ``DRAW_IDS`` at a time."""
    rows, k = out.shape
    step = max(1, DRAW_IDS // max(1, k))
    for lo in range(0, rows if k else 0, step):
        part = out[lo : lo + step]
        part[:] = generator.randint(0, rows, size=part.shape, dtype=np.int32)


def table_bytes(multi_hot_sizes: list[int], table_sizes: list[int]) -> int:
    """The host memory that one training process's lookup tables take (what a plan adds per rank)."""
    return np.dtype(np.int32).itemsize * sum(rows * size for rows, size in zip(table_sizes, multi_hot_sizes))


def check_host_memory(multi_hot_sizes: list[int], table_sizes: list[int], processes: int) -> None:
    """Refuses, naming the figures, tables that this host's ``processes`` training processes
    (each draws and holds its own) cannot hold together in the memory available now."""
    each = table_bytes(multi_hot_sizes, table_sizes)
    available = available_host_memory()
    if available is not None and processes * each > available:
        raise ConfigError(
            f"--multi_hot_sizes: MLPerf's multi-hot lookup tables take {_size(each)} in each of this "
            f"host's {processes} training processes ({_size(processes * each)} in all), but "
            f"{_size(available)} is available: use fewer processes per host (-j), hosts with more "
            "memory, or smaller tables or --multi_hot_sizes"
        )


def available_host_memory() -> int | None:
    """Bytes this host can still give its processes: MemAvailable, or less where this
    container's memory limit leaves less; None where neither is known (not Linux)."""
    figures = [figure for figure in (_meminfo_available(), *map(_cgroup_available, _CGROUPS)) if figure is not None]
    return min(figures, default=None)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _cgroup_available(files: tuple[str, str, str, str]) -> int | None:
    """A cgroup's limit less its usage, its reclaimable page cache (the mapped Criteo days')
    counted as free, as the kernel counts it before it kills; None without a limit."""
    limit_file, usage_file, stat_file, inactive = files
    try:
        with open(limit_file) as f:
            limit = f.read().strip()
        if not limit.isdigit():  # "max": none
            return None
        with open(usage_file) as f:
            usage = int(f.read())
        with open(stat_file) as f:
            cache = next((int(line.split()[1]) for line in f if line.startswith(inactive + " ")), 0)
    except (OSError, ValueError):  # no such cgroup version here, or not readable
        return None
    return int(limit) - usage + cache


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def expand(ids: np.ndarray, tables: list[np.ndarray], out: np.ndarray) -> None:
    """Writes the multi-hot ids of one-hot ``ids`` [features, batch] into ``out``, as KJT values.

    ``out`` holds ``batch * sum(multi_hot_sizes)`` values, feature after feature and, within a
    feature, sample after sample (the order of a ``KeyedJaggedTensor``'s values).
    """
    at = 0
    for feature_ids, table in zip(ids, tables):
        n = feature_ids.size * table.shape[1]
        np.take(table, feature_ids, axis=0, out=out[at : at + n].reshape(feature_ids.size, table.shape[1]))
        at += n
