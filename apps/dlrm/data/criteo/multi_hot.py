"""MLPerf DLRMv2's multi-hot Criteo: several ids per sample per feature, derived from the one-hot id.

The Criteo click logs have one id per categorical feature. MLPerf's DLRMv2 benchmark (TorchRec's
``torchrec_dlrm`` example, ``multi_hot.py`` and ``scripts/materialize_synthetic_multihot_dataset.py``)
turns each into ``multi_hot_sizes[f]`` ids by a fixed lookup table per feature: row ``i`` of the
table of feature ``f`` is ``i`` itself followed by ``multi_hot_sizes[f] - 1`` ids drawn uniformly
from ``[0, rows_f)``. The tables are drawn once, feature after feature, from NumPy's legacy
generator seeded with 0, so every rank and every run derives the same ids. We draw them the same
way, which makes our multi-hot Criteo batches those of the MLPerf reference (tests/test_multi_hot.py
checks ours against the reference's output on a sample).

The tables are held in memory by every training process, as in the reference: 4 bytes per extra
id per row, about 23 GB for MLPerf's table sizes and multi-hot sizes, and drawing them takes a
while (one random number per extra id).
"""

import numpy as np

#: Ids per sample of each of the 26 Criteo features in MLPerf's DLRMv2 (``--multi_hot_sizes`` of
#: TorchRec's torchrec_dlrm example and of MLPerf's reference, recommendation_v2/torchrec_dlrm).
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]

#: The seed of the reference's ``np.random.seed(0)``: the same tables on every rank.
MLPERF_SEED = 0


def multi_hot_tables(multi_hot_sizes: list[int], table_sizes: list[int]) -> list[np.ndarray]:
    """One int32 lookup table [rows_f, multi_hot_sizes[f]] per feature, drawn as MLPerf draws them.

    Column 0 is the one-hot id itself; the other columns are uniform in ``[0, rows_f)``. The draws
    of every feature, one-hot ones included, come from one generator in feature order: the
    tables of later features depend on the sizes of earlier ones, as in the reference.
    """
    generator = np.random.RandomState(MLPERF_SEED)
    tables = []
    for rows, size in zip(table_sizes, multi_hot_sizes):
        extra = generator.randint(0, rows, size=(rows, size - 1))
        tables.append(np.concatenate([np.arange(rows)[:, None], extra], axis=1).astype(np.int32))
    return tables


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
