"""Frequency-thresholded vocabularies of the categorical features (``--categorical_ids vocabulary``).

The ids are those of TorchRec's ``BinaryCriteoUtils.sparse_to_contiguous`` followed by the modulo
that its ``InMemoryBinaryCriteoIterDataPipe(hashes=...)`` applies: for each feature, the values
seen at least ``threshold`` times in all days are numbered 2, 3, ... in order of their first
appearance (days in order, rows in order), every rarer value is 1, and the id is that number
modulo the table size. A missing value is the value 0, as in TorchRec.

It takes three steps, each resumable:

1. per day, while the day is converted, :class:`ValueCounter` counts every value of every
   feature and remembers the row of its first appearance (``vocabulary/<day>_counts.npz``);
2. :func:`build_vocabulary` merges the days' counts feature by feature into a sorted table of
   the values and their ids (``vocabulary/cat_<f>_values.npy``, ``vocabulary/cat_<f>_ids.npy``);
3. :class:`Vocabulary` looks the values of a day up (a binary search per value) to write its ids.

Memory grows with the number of distinct values of a feature, not with the size of the input:
about 60 bytes per distinct value while merging (an estimate from the arrays involved; some
17 GB for the largest feature of the Criteo 1TB logs, ~290M values). The id tables are
memory-mapped, so the workers of the third step share one copy in the page cache.
"""

import os

import numpy as np

from apps.dlrm.data.criteo.layout import temporary_name
from apps.dlrm.data.criteo.tables import CAT_FEATURES

RARE_ID = 1
FIRST_ID = 2

_ROW_BITS = 32  # rows of one day < 2**32; a position is (day << 32) | row
_CHUNK_ROWS = 1 << 20  # rows counted at once: large sorts amortise numpy's per-call cost


def counts_file(folder: str, day: str) -> str:
    return os.path.join(folder, f"{day}_counts.npz")


def values_file(folder: str, day: str) -> str:
    return os.path.join(folder, f"{day}_values.npy")


def table_files(folder: str, feature: int) -> tuple[str, str]:
    return (
        os.path.join(folder, f"cat_{feature}_values.npy"),
        os.path.join(folder, f"cat_{feature}_ids.npy"),
    )


def _merge(values: np.ndarray, counts: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sums the counts and keeps the first position of equal values; returns them sorted."""
    # Stable sort: the inputs are concatenations of sorted runs, which timsort merges linearly.
    order = np.argsort(values, kind="stable")
    values, counts, first = values[order], counts[order], first[order]
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return values[starts], np.add.reduceat(counts, starts), np.minimum.reduceat(first, starts)


class ValueCounter:
    """Counts the values of the 26 features of one day, in row order."""

    def __init__(self) -> None:
        self.rows = 0
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        empty = (np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        self._tables = [empty] * CAT_FEATURES

    def add(self, cats: np.ndarray) -> None:
        """Counts a block of rows (uint32 [26, n], feature-major) that follows those added before."""
        self._pending.append(cats)
        self._pending_rows += cats.shape[1]
        if self._pending_rows >= _CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        chunk = np.concatenate(self._pending, axis=1)
        rows = np.arange(self.rows, self.rows + chunk.shape[1], dtype=np.uint64)
        for f in range(CAT_FEATURES):
            # One sort of (value, row) keys: groups equal values, first row first.
            keys = np.sort((chunk[f].astype(np.uint64) << np.uint64(_ROW_BITS)) | rows)
            values = (keys >> np.uint64(_ROW_BITS)).astype(np.uint32)
            starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
            counts = np.diff(np.r_[starts, len(keys)]).astype(np.int64)
            first = keys[starts] & np.uint64((1 << _ROW_BITS) - 1)
            old = self._tables[f]
            self._tables[f] = _merge(
                np.concatenate([old[0], values[starts]]),
                np.concatenate([old[1], counts]),
                np.concatenate([old[2], first]),
            )
        self.rows += chunk.shape[1]
        self._pending, self._pending_rows = [], 0

    def save(self, path: str) -> None:
        """Writes the counts (values, counts, first rows per feature) atomically."""
        self._flush()
        arrays: dict[str, np.ndarray] = {}
        for f, (values, counts, first) in enumerate(self._tables):
            arrays.update({f"values_{f}": values, f"counts_{f}": counts, f"first_{f}": first})
        tmp = temporary_name(path)
        with open(tmp, "wb") as out:
            np.savez(out, allow_pickle=False, **arrays)  # numbers only, as np.load reads them
        os.replace(tmp, path)


def build_vocabulary(count_paths: list[str], threshold: int, table_sizes: list[int], folder: str) -> list[int]:
    """Merges the days' counts (in day order) into per-feature id tables; returns the number
    of distinct values per feature."""
    days = [np.load(path) for path in count_paths]
    distinct = []
    for f in range(CAT_FEATURES):
        values, counts, first = (np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        for d, day in enumerate(days):
            values, counts, first = _merge(
                np.concatenate([values, day[f"values_{f}"]]),
                np.concatenate([counts, day[f"counts_{f}"]]),
                np.concatenate([first, (np.uint64(d) << np.uint64(_ROW_BITS)) | day[f"first_{f}"]]),
            )
        frequent = counts >= threshold if threshold > 1 else np.ones(len(values), dtype=bool)
        ids = np.full(len(values), RARE_ID, dtype=np.int64)
        frequent_at = np.flatnonzero(frequent)
        ids[frequent_at[np.argsort(first[frequent_at], kind="stable")]] = np.arange(
            FIRST_ID, FIRST_ID + len(frequent_at)
        )
        values_path, ids_path = table_files(folder, f)
        for path, array in ((values_path, values), (ids_path, (ids % table_sizes[f]).astype(np.int32))):
            tmp = temporary_name(path)
            with open(tmp, "wb") as out:
                np.save(out, array)
            os.replace(tmp, path)
        distinct.append(len(values))
    return distinct


class Vocabulary:
    """The id tables of the 26 features, memory-mapped (shared by all worker processes)."""

    def __init__(self, folder: str) -> None:
        self._tables = [
            (np.load(values, mmap_mode="r"), np.load(ids, mmap_mode="r"))
            for values, ids in (table_files(folder, f) for f in range(CAT_FEATURES))
        ]

    def lookup(self, cats: np.ndarray) -> np.ndarray:
        """The ids (int32 [n, 26]) of the values (uint32 [n, 26]) of days it was built from."""
        ids, unseen = self._ids(cats, None)
        if unseen.any():
            f = int(np.flatnonzero(unseen.any(axis=0))[0])
            raise ValueError(
                f"categorical feature {f} has a value the vocabulary was not built from: "
                "the vocabulary is stale; remove the vocabulary folder and rerun"
            )
        return ids

    def lookup_or_rare(self, cats: np.ndarray, table_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids (int32 [n, 26]) of any values (uint32 [n, 26]), and which rows held a value the
        vocabulary was not built from (bool [n]): scoring new days meets such values, whose id is
        the rare values' (RARE_ID modulo the table's size in ``table_sizes``), as a value seen
        fewer than the threshold's times is: never seen is rarer still."""
        ids, unseen = self._ids(cats, table_sizes)
        return ids, np.asarray(unseen.any(axis=1))

    def _ids(self, cats: np.ndarray, table_sizes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``cats`` and where a value is not in its table (there: the rare id modulo
        ``table_sizes``, or 0 without them)."""
        ids = np.empty(cats.shape, dtype=np.int32)
        unseen = np.empty(cats.shape, dtype=bool)
        for f, (values, table) in enumerate(self._tables):
            if not len(values):
                unseen[:, f] = True
                ids[:, f] = 0
            else:
                at = np.minimum(np.searchsorted(values, cats[:, f]), len(values) - 1)
                unseen[:, f] = values[at] != cats[:, f]
                ids[:, f] = table[at]
            if table_sizes is not None:
                ids[unseen[:, f], f] = RARE_ID % table_sizes[f]
        return ids, unseen
