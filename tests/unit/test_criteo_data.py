"""The Criteo training dataset: splits, rank partitioning, shuffling, exact resume, evaluation.

The folders here are written directly in the documented layout, with every row's dense feature 0
holding its row number, so each test can tell exactly which rows a batch holds.
"""

import os
import threading

import numpy as np
import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.core.data import RankShare
from apps.core.options import to_argv
from apps.dlrm.config import train_config
from apps.dlrm.data.criteo.fetch import local_folder
from apps.dlrm.data.criteo.layout import FORMAT, FORMAT_VERSION, array_file, checksums, day_report_file, write_json
from apps.dlrm.data.criteo.loader import CriteoClickLogs

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

TABLES = 1000


def write_folder(folder, rows_per_day: list[int], sizes: int = TABLES) -> str:
    """A preprocessed folder whose row r has dense[0] = r, label r % 2 and ids (r + f) % sizes."""
    os.makedirs(folder, exist_ok=True)
    days = [f"day_{d}" for d in range(len(rows_per_day))]
    first = 0
    for day, rows in zip(days, rows_per_day):
        r = np.arange(first, first + rows)
        dense = np.zeros((rows, 13), np.float32)
        dense[:, 0] = r
        np.save(os.path.join(folder, array_file(day, "dense")), dense)
        np.save(
            os.path.join(folder, array_file(day, "sparse")), ((r[:, None] + np.arange(26)) % sizes).astype(np.int32)
        )
        np.save(os.path.join(folder, array_file(day, "labels")), (r % 2).astype(np.int32)[:, None])
        write_json(os.path.join(folder, day_report_file(day)), {})
        first += rows
    write_json(
        os.path.join(folder, "manifest.json"),
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "categorical_ids": "hash",
            "num_embeddings_per_feature": [sizes] * 26,
            "days": days,
            "files": checksums(folder, days),
        },
    )
    return str(folder)


def dataset(folder, rank=0, world=1, **kwargs) -> CriteoClickLogs:
    cfg = train_config(**{"data": "criteo", "data_path": folder, "num_embeddings": TABLES, "batch_size": 100, **kwargs})
    return CriteoClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training, rank, world), folder, pin_memory=False)


def rows_of(batch) -> list[int]:
    return batch.dense_features[:, 0].long().tolist()


def take(iterator, n):
    batches = [next(iterator) for _ in range(n)]
    iterator.close()
    return batches


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # 5 days; the last holds validation (first half) and test (second half) rows.
    return write_folder(tmp_path_factory.mktemp("npy"), [700, 650, 800, 733, 1001])


def test_splits_are_the_last_day_halves_and_configurable(folder):
    assert dataset(folder).splits == {"train": (0, 2883), "val": (2883, 3384), "test": (3384, 3884)}
    two_days = dataset(folder, eval_days=2, eval_fraction=0.5).splits
    assert two_days == {"train": (0, 3017), "val": (3017, 3451), "test": (3451, 3884)}  # 867 held out


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_share_each_global_batch_without_overlap_and_an_epoch_uses_rows_once(folder, shuffle):
    world = 3
    ranks = [dataset(folder, r, world, shuffle=shuffle, shuffle_block_rows=64) for r in range(world)]
    steps = ranks[0].steps_per_epoch
    assert steps == 2883 // 300
    seen = []
    for data in ranks:
        for batch in take(data.train_batches(0), steps):
            rows = rows_of(batch)
            assert len(rows) == 100
            seen += rows
            assert batch.labels.tolist() == [row % 2 for row in rows]  # the row's own label
            assert batch.sparse_features.values().view(26, 100)[3].tolist() == [(row + 3) % TABLES for row in rows]
    assert len(set(seen)) == len(seen) == steps * 300
    assert set(seen) <= set(range(2883))
    if not shuffle:
        assert sorted(seen) == list(range(steps * 300))
        assert rows_of(next(ranks[1].train_batches(0))) == list(range(100, 200))


def test_resuming_at_any_step_yields_the_batches_of_an_uninterrupted_run(folder):
    data = dataset(folder, 1, 2, seed=5, shuffle_block_rows=32)
    steps = 3 * data.steps_per_epoch + 2  # across epoch boundaries
    uninterrupted = [rows_of(b) for b in take(data.train_batches(0), steps)]
    for start in (1, data.steps_per_epoch - 1, data.steps_per_epoch, 2 * data.steps_per_epoch + 3):
        resumed = [
            rows_of(b) for b in take(dataset(folder, 1, 2, seed=5, shuffle_block_rows=32).train_batches(start), 3)
        ]
        assert resumed == uninterrupted[start : start + 3]


def test_shuffling_differs_per_epoch_and_seed_and_keeps_blocks_together(folder):
    data = dataset(folder, seed=1, shuffle_block_rows=50)
    per_epoch = data.steps_per_epoch
    epochs = [sum((rows_of(b) for b in take(data.train_batches(e * per_epoch), per_epoch)), []) for e in range(2)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != epochs[0]
    other_seed = sum(
        (rows_of(b) for b in take(dataset(folder, seed=2, shuffle_block_rows=50).train_batches(0), per_epoch)), []
    )
    assert other_seed != epochs[0]
    runs = np.split(np.array(epochs[0]), np.flatnonzero(np.diff(epochs[0]) != 1) + 1)
    assert all(run[0] % 50 == 0 for run in runs)  # runs of consecutive rows start on a block edge


def test_evaluation_covers_the_split_with_equal_batch_counts(folder):
    world = 3
    for split in ("val", "test"):
        start, stop = dataset(folder).splits[split]
        per_rank = [[rows_of(b) for b in dataset(folder, r, world).eval_batches(split, 0)] for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1  # collectives need equal counts
        rows = sorted(row for batches in per_rank for batch in batches for row in batch)
        assert rows == list(range(start, stop))[: len(rows)] and stop - start - len(rows) < world
        capped = [rows_of(b) for b in dataset(folder, 1, world).eval_batches(split, 1)]
        assert capped == per_rank[1][:1]
    assert len(list(dataset(folder).eval_batches("val", 1000))) == 6  # more than there is: all


def test_batches_are_torchrec_batches(folder):
    data = dataset(folder)
    batch = next(data.eval_batches("test", 0))
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{f}" for f in range(26)]
    assert kjt.values().dtype == torch.int32 and kjt.values().shape == (2600,)
    assert torch.equal(kjt.lengths(), torch.ones(2600, dtype=torch.int32))
    assert kjt.stride() == 100 and kjt["cat_1"].values().tolist() == [(r + 1) % TABLES for r in rows_of(batch)]
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (100, 13)
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (100,)
    assert data.teacher() is None


def test_prefetch_thread_stops_with_its_iterator(folder):
    def prefetchers():
        return [t for t in threading.enumerate() if t.name == "criteo-prefetch"]

    before = set(prefetchers())  # those of other tests' iterators may still be winding down
    iterator = dataset(folder).train_batches(0)
    next(iterator)
    (thread,) = set(prefetchers()) - before
    iterator.close()  # returns once the thread has ended: none may outlive the training run
    assert not thread.is_alive()


def test_folders_that_do_not_fit_are_refused_with_the_fix(folder, tmp_path):
    with pytest.raises(ConfigError, match="--num_embeddings_per_feature 1000,1000"):
        dataset(folder, num_embeddings=500)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        dataset(folder, batch_size=3000)
    with pytest.raises(ConfigError, match="leaves no training rows"):
        dataset(folder, eval_days=5)
    with pytest.raises(ConfigError, match="has no manifest.json"):
        dataset(str(tmp_path))
    incomplete = write_folder(tmp_path / "incomplete", [300, 300])
    os.remove(os.path.join(incomplete, day_report_file("day_1")))
    with pytest.raises(ConfigError, match="day day_1 .* is incomplete"):
        dataset(incomplete)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(data="criteo"), "--data criteo needs --data_path"),
        (dict(data_path="/x"), "is read only with --data criteo"),
        (dict(data="criteo", data_path="/x", num_sparse_features=8), "must be 13 and 26"),
        (dict(eval_fraction=0.0), "--eval_fraction 0.0"),
        (dict(eval_days=0), "--eval_days 0"),
        (dict(table_size_preset="full", num_embeddings_per_feature=[5] * 26), "give only one"),
    ],
)
def test_bad_data_options_name_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        train_config(**kwargs)


def test_table_size_preset_survives_the_command_line():
    cfg = train_config(data="criteo", data_path="/x", table_size_preset="mlperf")
    assert cfg.model.table_sizes[0] == 40_000_000 and len(cfg.model.table_sizes) == 26
    from apps.dlrm.config import parse_train_config

    assert parse_train_config(to_argv(cfg)) == cfg


def test_a_url_is_copied_once_to_a_node_local_cache(folder, tmp_path, monkeypatch):
    import tempfile

    import fsspec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the checked files' stamps go
    memory = fsspec.filesystem("memory")
    for name in os.listdir(folder):
        memory.put(os.path.join(folder, name), f"/criteo/{name}")
    cache = str(tmp_path / "cache")
    assert local_folder("memory://criteo", cache, copier=True) == cache
    assert sorted(os.listdir(cache)) == sorted(os.listdir(folder))
    mtime = os.stat(os.path.join(cache, "day_0_sparse.npy")).st_mtime_ns
    local_folder("memory://criteo", cache, copier=True)  # checked before: not copied again
    assert os.stat(os.path.join(cache, "day_0_sparse.npy")).st_mtime_ns == mtime
    assert local_folder("memory://criteo", cache, copier=False) == cache  # the others only wait
    assert rows_of(next(dataset(cache).eval_batches("val", 1))) == list(range(2883, 2983))
    memory.rm("/criteo/day_1_labels.npy")
    with pytest.raises(ConfigError, match="lacks day_1_labels.npy"):
        local_folder("memory://criteo", str(tmp_path / "cache2"), copier=True)
