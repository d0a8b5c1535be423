"""Parquet windows taken in runs of rows, and the memory they are decoded into: pure logic."""

import gc

import numpy as np
import pytest
import torch

from apps.core.data import RankShare
from apps.dlrm.data.parquet.loader import assemble_batch
from apps.dlrm.data.parquet.order import Pieces, TrainOrder, block_permutation, run_rows
from apps.dlrm.data.parquet.pool import ArrayPool
from apps.dlrm.data.parquet.read import Ragged, Rows

TIER = "unit"


@pytest.mark.parametrize("block", [1, 7, 1024])
def test_a_windows_runs_between_any_positions_are_those_of_its_block_permutation(block):
    share = RankShare(rank=0, world_size=1, seed=5, batch_size=1000)
    order = TrainOrder(Pieces.of_groups([[3000, 2000]]), share, True, 5000, block)  # one window
    window = order.window(0, 0)
    permutation = block_permutation(np.random.default_rng([5, 0, 0, 0]), 5000, block)
    for first, last in [(0, 700), (700, 1400), (1023, 1025), (4300, 5000), (0, 5000)]:
        assert run_rows(window.runs_between(first, last)).tolist() == permutation[first:last].tolist()


def _rows(n: int, seed: int) -> Rows:
    """``n`` rows of 2 dense features, 3 sparse ones: the middle one of 0, 1 or 2 ids a row."""
    rng = np.random.default_rng(seed)
    counts = np.arange(n) % 3
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ragged = Ragged(rng.integers(0, 99, int(counts.sum())).astype(np.int32), offsets, counts.astype(np.int32))
    ids = rng.integers(0, 99, (3, n)).astype(np.int32)
    return Rows(rng.random((2, n), dtype=np.float32), rng.random(n, dtype=np.float32), ids, [None, ragged, None])


@pytest.mark.parametrize("block", [1, 7, 100])
def test_a_batch_copied_run_by_run_holds_the_rows_a_gather_of_its_index_takes(block):
    # Runs of `block` rows of a first part (gathered when short, copied when long), then two of a second.
    runs = np.array([[start, start + block] for start in range(500, 200, -block)])
    parts = [(_rows(1000, 0), runs), (_rows(300, 1), np.array([[200, 300], [0, 100]]))]
    batch = assemble_batch(parts, ["a", "b", "c"], 2, torch.int32)
    index = [run_rows(runs) for _, runs in parts]
    assert (
        batch.dense_features.tolist() == np.concatenate([r.dense[:, i].T for (r, _), i in zip(parts, index)]).tolist()
    )
    assert batch.labels.tolist() == np.concatenate([r.labels[i] for (r, _), i in zip(parts, index)]).tolist()
    kjt = batch.sparse_features
    for f, key in enumerate("abc"):
        expected_ids, expected_lengths = [], []
        for (rows, _), rows_index in zip(parts, index):
            for row in rows_index:
                ragged = rows.ragged[f]
                one = ragged is None
                expected_ids += (
                    [rows.ids[f, row]] if one else ragged.ids[ragged.offsets[row] : ragged.offsets[row + 1]].tolist()
                )
                expected_lengths.append(1 if one else int(ragged.lengths[row]))
        assert kjt[key].values().tolist() == expected_ids
        assert kjt[key].lengths().tolist() == expected_lengths


def test_pool_memory_is_handed_out_again_only_once_its_rows_are_gone():
    pool = ArrayPool()
    shapes = [(3, np.dtype(np.int64)), (2, np.dtype(np.float32))]
    memory, (ids, dense) = pool.arrays(1000, shapes)
    assert ids.shape == (3, 1000) and dense.shape == (2, 1000) and ids.ctypes.data % 8 == 0
    rows = Rows(dense, dense[0], ids, [None] * 3)
    pool.lend(rows, memory)
    other, _ = pool.arrays(1000, shapes)
    assert not np.shares_memory(other, memory)  # rows still live: fresh memory
    del rows, ids, dense
    gc.collect()
    again, (ids, dense) = pool.arrays(900, shapes)
    assert again is memory  # rows gone: reused, as it is large enough
    rows = Rows(dense, dense[0], ids, [None] * 3)
    pool.lend(rows, again)
    del rows, ids, dense
    bigger, _ = pool.arrays(2000, shapes)
    assert not np.shares_memory(bigger, memory)  # too small for 2000 rows: fresh memory
