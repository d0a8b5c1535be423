"""Parquet click logs (--data parquet): rank shares, shuffling, exact resume, evaluation, ids,
multi-hot lists, nulls, every bad input, and a training run from S3 (moto) that resumes exactly.

The files here are written by the tests with every row's dense feature int_0 holding its row
number (in file order), so each test can tell exactly which rows a batch holds.
"""

import json
import logging
import os
import re
import shutil
import sys
import threading

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import mix64_int, text_fingerprints
from apps.core.common.splits import held_out_split
from apps.core.data import RankShare
from apps.dlrm.config import train_config
from apps.dlrm.data.parquet.files import ColumnSpec
from apps.dlrm.data.parquet.loader import PREFETCH_THREAD, READ_AHEAD_THREAD, ParquetClickLogs
from apps.dlrm.data.parquet.order import Pieces, block_permutation, eval_runs
from testing.moto_server import REGION
from tests.conftest import assert_ok, run, tiny
from tests.unit.test_criteo_data import rows_of, take

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

TABLES = 1000
DENSE = ["int_0", "int_1", "int_2"]
SPARSE = ["cat_0", "cat_1", "cat_2", "cat_3"]
ROWS = [700, 650, 800, 733, 1001]  # five files; the last holds the validation and test rows


def table(first: int, rows: int, **columns: pa.Array) -> pa.Table:
    """Rows ``first ...``: label r % 2, int_0 = r, int_1 = -r, int_2 = 0.5, cat_f = (r + f) % TABLES."""
    r = np.arange(first, first + rows)
    data = {
        "label": pa.array(r % 2, pa.int8()),
        "int_0": pa.array(r, pa.int64()),
        "int_1": pa.array(-r, pa.float64()),
        "int_2": pa.array(np.full(rows, 0.5, np.float32)),
    }
    data.update({f"cat_{f}": pa.array((r + f) % TABLES, pa.int64()) for f in range(len(SPARSE))})
    data.update(columns)
    return pa.table(data)


def write_files(fs, folder: str, rows_per_file=ROWS, group_rows: int = 128, **write_options) -> str:
    """One file per entry of ``rows_per_file``, in row groups of ``group_rows``."""
    fs.makedirs(folder, exist_ok=True)
    first = 0
    for d, rows in enumerate(rows_per_file):
        with fs.open(f"{folder}/day_{d}.parquet", "wb") as f:
            pq.write_table(table(first, rows), f, row_group_size=group_rows, **write_options)
        first += rows
    return folder


def dataset(path, rank=0, world=1, **kwargs) -> ParquetClickLogs:
    options = {
        "data": "parquet",
        "data_path": str(path),
        "num_embeddings": TABLES,
        "batch_size": 100,
        "dense_columns": DENSE,
        "sparse_columns": SPARSE,
        "categorical_ids": "as_is",
        "shuffle_buffer_rows": 300,
        "shuffle_block_rows": 20,
        **kwargs,
    }
    cfg = train_config(**options)
    return ParquetClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training, rank, world), pin_memory=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_files(fsspec.filesystem("file"), str(tmp_path_factory.mktemp("parquet")))


@pytest.mark.unit
def test_splits_are_the_last_file_halves_and_batches_hold_each_rows_own_values(folder):
    data = dataset(folder)
    assert data.splits == {"train": (0, 2883), "val": (2883, 3384), "test": (3384, 3884)}
    assert data.steps_per_epoch == 28
    batch = next(data.eval_batches("test", 1))
    rows = rows_of(batch)
    assert rows == list(range(3384, 3484))
    assert batch.labels.tolist() == [r % 2 for r in rows]
    assert batch.dense_features[:, 1].tolist() == [-r for r in rows]
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{f}" for f in range(4)] and kjt.stride() == 100
    assert kjt.values().dtype == torch.int32 and torch.equal(kjt.lengths(), torch.ones(400, dtype=torch.int32))
    assert kjt["cat_3"].values().tolist() == [(r + 3) % TABLES for r in rows]
    assert data.teacher() is None


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_read_disjoint_shares_and_an_epoch_uses_rows_once(folder, shuffle):
    world = 3
    ranks = [dataset(folder, r, world, shuffle=shuffle) for r in range(world)]
    steps = ranks[0].steps_per_epoch
    assert steps == (2883 // 3) // 100 and {r.steps_per_epoch for r in ranks} == {steps}
    per_rank = [sum((rows_of(b) for b in take(data.train_batches(0), steps)), []) for data in ranks]
    seen = sum(per_rank, [])
    assert len(seen) == len(set(seen)) == steps * 300 and set(seen) <= set(range(2883))
    for batch in take(ranks[1].train_batches(0), 2):
        assert batch.sparse_features["cat_1"].values().tolist() == [(r + 1) % TABLES for r in rows_of(batch)]
    if not shuffle:  # file order: each rank a run of 961 rows, of which 900 train this epoch
        assert per_rank[1] == list(range(961, 961 + 900))


def test_resuming_at_any_step_yields_the_batches_of_an_uninterrupted_run(folder):
    data = dataset(folder, 1, 2, seed=5)
    per_epoch = data.steps_per_epoch
    uninterrupted = [rows_of(b) for b in take(data.train_batches(0), 2 * per_epoch + 3)]
    # Step 4 starts inside a 300-row window, in the middle of a row group; per_epoch - 1 spans
    # the end of an epoch; per_epoch and 2 * per_epoch + 1 start in a new epoch's order.
    for start in (4, per_epoch - 1, per_epoch, 2 * per_epoch + 1):
        resumed = [rows_of(b) for b in take(dataset(folder, 1, 2, seed=5).train_batches(start), 2)]
        assert resumed == uninterrupted[start : start + 2], start


@pytest.mark.unit
def test_shuffling_mixes_rows_across_row_groups_and_differs_per_epoch_and_seed(folder):
    data = dataset(folder, seed=1)
    per_epoch = data.steps_per_epoch
    epochs = [sum((rows_of(b) for b in take(data.train_batches(e * per_epoch), per_epoch)), []) for e in (0, 1)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != epochs[0]
    first_batch = rows_of(next(dataset(folder, seed=1).eval_batches("val", 1)))
    assert first_batch == sorted(first_batch)  # evaluation reads in file order
    assert len({r // 128 for r in epochs[0][:100]}) > 1  # a batch mixes row groups
    other_seed = sum((rows_of(b) for b in take(dataset(folder, seed=2).train_batches(0), per_epoch)), [])
    assert other_seed != epochs[0]


def runs_of_consecutive_rows(rows: list[int]) -> list[int]:
    """The lengths of the runs of consecutive row numbers that ``rows`` is made of."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return np.diff([0, *breaks, len(rows)]).tolist()


@pytest.mark.unit
def test_windows_are_shuffled_in_blocks_of_consecutive_rows_and_blocks_of_one_permute_rows(folder):
    per_epoch = dataset(folder).steps_per_epoch
    rows = sum((rows_of(b) for b in take(dataset(folder, seed=3).train_batches(0), per_epoch)), [])
    runs = runs_of_consecutive_rows(rows)
    # Blocks of 20 rows, cut short where a window's pieces meet (a row group's end, a split's
    # edge), joined where consecutive blocks happen to follow each other; never a batch in file order.
    assert runs.count(20) > len(runs) // 2 and max(runs) < 100
    single = sum(
        (rows_of(b) for b in take(dataset(folder, seed=3, shuffle_block_rows=1).train_batches(0), per_epoch)), []
    )
    assert sorted(single) == sorted(rows) and max(runs_of_consecutive_rows(single)) <= 3


@pytest.mark.unit
def test_a_block_permutation_of_one_row_blocks_is_the_generators_permutation():
    for rows, block in ((1000, 1), (1000, 64), (7, 3), (5, 10)):
        order = block_permutation(np.random.default_rng([4, 2]), rows, block)
        assert sorted(order) == list(range(rows))
        inside = order % block != 0  # a row that does not start a block follows its block's previous row
        assert not inside[0] and (order[1:][inside[1:]] == order[:-1][inside[1:]] + 1).all()
    assert block_permutation(np.random.default_rng([4, 2]), 1000, 1).tolist() == (
        np.random.default_rng([4, 2]).permutation(1000).tolist()
    )


@pytest.mark.unit
def test_evaluation_gives_every_rank_the_same_number_of_batches(folder):
    world = 3
    for split in ("val", "test"):
        start, stop = dataset(folder).splits[split]
        per_rank = [[rows_of(b) for b in dataset(folder, r, world).eval_batches(split, 0)] for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        rows = sorted(row for batches in per_rank for batch in batches for row in batch)
        assert rows == list(range(start, stop))[: len(rows)] and stop - start - len(rows) < world
        assert [rows_of(b) for b in dataset(folder, 2, world).eval_batches(split, 1)] == per_rank[2][:1]
    assert eval_runs(10, 100, RankShare(rank=1, world_size=3, seed=0, batch_size=2), 0) == [(103, 105), (105, 106)]


@pytest.mark.unit
def test_pieces_cut_row_groups_at_any_row():
    pieces = Pieces.of_groups([[5, 3], [4]])
    assert pieces.rows == 12
    assert pieces.between(4, 10).as_list() == [(0, 0, 4, 5), (0, 1, 0, 3), (1, 0, 0, 2)]
    assert pieces.between(5, 8).as_list() == [(0, 1, 0, 3)]


@pytest.mark.unit
def test_loader_threads_stop_with_their_iterator(folder):
    def threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith((PREFETCH_THREAD, READ_AHEAD_THREAD))}

    before = threads()  # those of other tests' iterators may still be winding down
    iterator = dataset(folder).train_batches(0)
    next(iterator)
    started = threads() - before
    assert {t.name.split("_")[0] for t in started} == {PREFETCH_THREAD, READ_AHEAD_THREAD}
    iterator.close()  # returns once they have ended: none may outlive the training run
    assert not any(t.is_alive() for t in started)


def mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, written out here in numpy, independently of the code under test."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@pytest.mark.unit
def test_hashed_ids_are_a_fixed_mix_modulo_the_table(folder):
    batch = next(dataset(folder, categorical_ids="hash", num_embeddings=97).eval_batches("val", 1))
    rows = np.array(rows_of(batch))
    expected = mix64((rows + 2) % TABLES) % np.uint64(97)
    assert batch.sparse_features["cat_2"].values().tolist() == expected.tolist()


def write_one(tmp_path, name: str, data: pa.Table, **options) -> str:
    folder = tmp_path / name
    folder.mkdir()
    pq.write_table(data, folder / "day_0.parquet", **options)
    return str(folder)


@pytest.mark.unit
def test_list_columns_are_multi_hot_and_nulls_are_counted_and_filled(tmp_path):
    rows = 400
    r = np.arange(rows)
    lists = [[int(v), int(v) + 1][: int(v) % 3] for v in r]  # 0, 1 or 2 ids
    lists[5], lists[7] = None, [9, None, 11]  # a null list, a null element
    dense = pa.array([None if v % 10 == 3 else float(v) for v in r], pa.float32())
    ids = pa.array([None if v % 50 == 1 else int(v) for v in r], pa.int32())
    data = table(0, rows, int_0=pa.array(r), int_1=dense, cat_1=pa.array(lists, pa.list_(pa.int64())), cat_2=ids)
    source = dataset(write_one(tmp_path, "lists", data), batch_size=50, eval_fraction=0.5, shuffle_buffer_rows=64)
    assert source.spec.multi_hot == [False, True, False, False]
    assert source.null_counts == {"label": 0, "int_0": 0, "int_1": 40, "int_2": 0, "cat_0": 0, "cat_2": 8, "cat_3": 0}
    batch = next(source.train_batches(0))
    kjt, got = batch.sparse_features, rows_of(batch)
    expected = [[] if v == 5 else [9, 11] if v == 7 else lists[v] for v in got]
    assert kjt["cat_1"].lengths().tolist() == [len(ids) for ids in expected]
    assert kjt["cat_1"].values().tolist() == sum(expected, [])
    assert kjt["cat_2"].lengths().tolist() == [0 if v % 50 == 1 else 1 for v in got]
    assert batch.dense_features[:, 1].tolist() == [0.0 if v % 10 == 3 else float(v) for v in got]
    assert kjt.values().shape[0] == sum(kjt.length_per_key())


def contents(batch) -> tuple[list, ...]:
    """Everything a batch holds, as lists: to compare the batches of two sources."""
    kjt = batch.sparse_features
    return batch.labels.tolist(), batch.dense_features.tolist(), kjt.values().tolist(), kjt.lengths().tolist()


def write_two(folder, first: pa.Table, second: pa.Table) -> str:
    """A folder of two files."""
    os.makedirs(folder)
    pq.write_table(first, os.path.join(folder, "day_0.parquet"))
    pq.write_table(second, os.path.join(folder, "day_1.parquet"))
    return str(folder)


def retyped(data: pa.Table, name: str, field: pa.Field) -> pa.Table:
    return data.set_column(data.schema.get_field_index(name), field, data.column(name).cast(field.type))


def id_lists(first: int, rows: int) -> pa.Array:
    """Rows ``first ...`` of a list column: row r holds 0, 1 or 2 ids (r % 3)."""
    return pa.array([[r % TABLES, (r + 1) % TABLES][: r % 3] for r in range(first, first + rows)], pa.list_(pa.int64()))


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, field",
    [
        ("cat_0", pa.field("cat_0", pa.int32())),
        ("int_0", pa.field("int_0", pa.int32())),
        ("int_1", pa.field("int_1", pa.float32())),
        ("label", pa.field("label", pa.float32())),
        ("label", pa.field("label", pa.bool_())),
        ("cat_2", pa.field("cat_2", pa.int64(), nullable=False)),
        ("cat_1", pa.field("cat_1", pa.list_(pa.int32()))),
        ("cat_1", pa.field("cat_1", pa.list_(pa.field("item", pa.int64(), nullable=False)))),
        ("int_0", pa.field("int_0", pa.decimal128(19, 0))),
        ("int_1", pa.field("int_1", pa.decimal256(40, 3))),
        ("label", pa.field("label", pa.decimal128(3, 0))),
    ],
)
def test_files_whose_types_differ_only_in_width_or_nullability_read_as_one(tmp_path, name, field):
    """Spark's and BigQuery's exports often differ so from file to file: each column reads as one
    type, with the values of files that agree (windows of 1000 rows mix both files' rows). Decimal
    numbers (BigQuery's NUMERIC, Spark's DecimalType) are numbers, read as float32 as a double is."""
    first, second = (table(r, 300, cat_1=id_lists(r, 300)) for r in (0, 300))
    same = write_two(tmp_path / "same", first, second)
    mixed = write_two(tmp_path / "mixed", first, retyped(second, name, field))
    options = dict(eval_fraction=0.5, batch_size=50, shuffle_buffer_rows=1000)
    expected = [contents(b) for b in take(dataset(same, **options).train_batches(0), 9)]
    assert [contents(b) for b in take(dataset(mixed, **options).train_batches(0), 9)] == expected


@pytest.mark.unit
@pytest.mark.parametrize("text_type", [pa.large_string(), pa.binary()])
def test_text_ids_read_alike_whether_a_file_holds_them_as_string_large_string_or_bytes(tmp_path, text_type):
    first, second = (table(r, 300, cat_1=pa.array([f"u{k % 11}" for k in range(r, r + 300)])) for r in (0, 300))
    same = write_two(tmp_path / "same", first, second)
    mixed = write_two(tmp_path / "mixed", first, retyped(second, "cat_1", pa.field("cat_1", text_type)))
    options = dict(eval_fraction=0.5, batch_size=50, shuffle_buffer_rows=1000, categorical_ids="hash")
    expected = [contents(b) for b in take(dataset(same, **options).train_batches(0), 9)]
    assert [contents(b) for b in take(dataset(mixed, **options).train_batches(0), 9)] == expected


@pytest.mark.unit
def test_a_dot_in_a_column_name_is_part_of_the_name(tmp_path):
    """``cat.0`` is a column of its own, not a field of ``cat``; ``label.x`` beside ``label``
    (its nulls recorded in its statistics) is not the label."""
    data = table(0, 300).rename_columns(["label", *DENSE, "cat.0", *SPARSE[1:]])
    data = data.append_column("label.x", pa.array([None] * 300, pa.int8()))
    source = dataset(write_one(tmp_path, "dots", data), sparse_columns=["cat.0", *SPARSE[1:]], eval_fraction=0.5)
    assert source.null_counts["cat.0"] == 0 and source.null_counts["label"] == 0
    batch = next(source.eval_batches("val", 1))
    assert batch.sparse_features["cat_0"].values().tolist() == [r % TABLES for r in rows_of(batch)]


@pytest.mark.unit
def test_nan_and_infinite_dense_values_train_as_nulls_do_and_are_counted(tmp_path, caplog):
    r = np.arange(300)
    values = r.astype(np.float64)
    values[r % 10 == 3], values[r % 50 == 7], values[r % 50 == 8] = np.nan, np.inf, -np.inf
    source = dataset(write_one(tmp_path, "nan", table(0, 300, int_1=pa.array(values))), eval_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        batches = list(source.eval_batches("val", 0))  # reads the one row group, whole
        rows = sum((rows_of(b) for b in batches), [])
        expected = [v if np.isfinite(v) else 0.0 for v in values[rows]]
        assert sum((b.dense_features[:, 1].tolist() for b in batches), []) == expected
        assert source.nonfinite_counts == {"int_1": np.count_nonzero(~np.isfinite(values))}
        take(source.train_batches(0), 1)  # the total so far is logged when training ends
    assert "day_0.parquet: dense column 'int_1' holds NaN or infinite values (row group 0)" in caplog.text
    assert re.search(r"NaN or infinite dense values read \(trained as 0, as nulls are\): int_1 \d+", caplog.text)


@pytest.mark.unit
def test_unscaled_dense_columns_are_warned_of_and_log1p_reads_the_log_of_their_clipped_values(tmp_path, caplog):
    r = np.arange(300)
    path = write_one(tmp_path, "counts", table(0, 300, int_2=pa.array((r * 100.0) ** 2)))  # raw counts, up to 8.9e8
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        plain = dataset(path, eval_fraction=0.5)
    # int_0 (r) and int_1 (-r) reach only 299: values the MLPs take as they are.
    assert "which an MLP trains poorly on: int_2 (up to 8.94e+08); give --dense_transform log1p" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        logged = dataset(path, eval_fraction=0.5, dense_transform="log1p")
    # int_2 is no longer warned of; int_1's negative values are, as log1p's clip makes them 0.
    assert "which an MLP trains poorly on" not in caplog.text
    assert (
        "--dense_transform log1p makes negative values 0 (log(1 + max(x, 0))), and dense columns hold some: int_1 (down to -299)"
        in caplog.text
    )
    batches = list(zip(plain.eval_batches("val", 0), logged.eval_batches("val", 0)))
    assert sum(len(rows_of(read)) for read, _ in batches) == 75  # the validation half of the held-out half
    for read, transformed in batches:
        expected = np.log1p(np.maximum(read.dense_features.numpy(), 0))  # int_1 = -r clips to 0
        # Bit for bit: numpy picks log1p's kernel by the CPU, and both arrays are contiguous.
        assert np.array_equal(transformed.dense_features.numpy(), expected)


@pytest.mark.unit
def test_columns_null_in_every_row_are_warned_of(tmp_path, caplog):
    nothing = dict(int_2=pa.array([None] * 300, pa.float32()), cat_1=pa.array([None] * 300, pa.int64()))
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        dataset(write_one(tmp_path, "nulls", table(0, 300, **nothing)), eval_fraction=0.5)
    assert (
        "columns null in all 300 rows, which train as constants (dense 0, sparse no id): int_2, cat_1; check the "
        "columns' names, or where the files are written"
    ) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        dataset(write_one(tmp_path, "some", table(0, 300, int_2=pa.array([None] * 299 + [1.0]))), eval_fraction=0.5)
    assert "null in all" not in caplog.text


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64, byte by byte, as its authors define it."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


@pytest.mark.unit
def test_text_fingerprints_are_fnv1a_of_the_bytes_of_any_arrow_text():
    values = ["", "a", "68fd1e64", "é", "x" * 300, "ab"]
    expected = [fnv1a64(v.encode()) for v in values]
    for array in (pa.array(values), pa.array(values, pa.large_string()), pa.array([v.encode() for v in values])):
        assert text_fingerprints(array).tolist() == expected
        assert text_fingerprints(array.slice(2, 3)).tolist() == expected[2:5]  # an offset into the buffers
    assert text_fingerprints(pa.array([], pa.string())).tolist() == []
    hex_ids = ["68fd1e64", "00000000", "ffffffff", "05db9164"]  # one width: bytes read as a matrix
    for array in (pa.array(hex_ids), pa.array(["x", *hex_ids]).slice(1)):
        assert text_fingerprints(array).tolist() == [fnv1a64(v.encode()) for v in hex_ids]


@pytest.mark.unit
def test_text_ids_are_hashed_alike_in_any_file_nulls_are_no_id_and_lists_are_bags(tmp_path):
    r = np.arange(300)
    texts = pa.array([None if k % 7 == 0 else f"user-{k % 13}" for k in r])
    lists = pa.array([[f"tag{k % 5}", f"tag{(k + 1) % 5}"] for k in r])
    path = write_one(tmp_path, "text", table(0, 300, cat_1=texts, cat_3=lists))
    source = dataset(path, eval_fraction=0.5, categorical_ids="hash", multi_hot_sizes=[1, 1, 1, 2])
    batch = next(source.eval_batches("val", 1))
    rows = rows_of(batch)

    def ids(text: str) -> int:
        return mix64_int(fnv1a64(text.encode())) % 2**64 % TABLES

    one = batch.sparse_features["cat_1"]
    assert one.lengths().tolist() == [0 if k % 7 == 0 else 1 for k in rows]  # a null is no id
    assert one.values().tolist() == [ids(f"user-{k % 13}") for k in rows if k % 7]
    bags = batch.sparse_features["cat_3"]
    assert bags.values().tolist() == [ids(f"tag{(k + d) % 5}") for k in rows for d in (0, 1)]


@pytest.mark.unit
@pytest.mark.parametrize(
    "change, kwargs, fragment",
    [
        (dict(cat_3=None), {}, "day_0.parquet has no column 'cat_3' (--sparse_columns)"),
        (
            dict(cat_2=pa.array(["68fd1e64"] * 300)),  # Criteo's raw values are hex text: hashed, not as_is
            {},
            "day_0.parquet: column 'cat_2' (--sparse_columns) is string: text ids become table rows with "
            "--categorical_ids hash",
        ),
        (dict(cat_1=pa.array([["a"]] * 300)), {}, "is list<element: string>: text ids become table rows with"),
        (dict(cat_1=pa.array([[1.5]] * 300)), {}, "is list<element: double>, but it must hold integers, text or lists"),
        (dict(int_1=pa.array([[1.0]] * 300)), {}, "column 'int_1' (--dense_columns) is list<element: double>"),
        (dict(cat_0=pa.array(np.full(300, 1000))), {}, "column 'cat_0' holds id 1000 (row group 0)"),
        (dict(label=pa.array([None] + [1] * 299, pa.int8())), {}, "label column 'label' has 1 null values"),
        (dict(label=pa.array([0] * 299 + [2], pa.int8())), {}, "label column 'label' holds 2 (row group 0)"),
        (dict(label=pa.array([-1.0] + [1.0] * 299)), {}, "label column 'label' holds -1 (row group 0)"),
        (dict(label=pa.array([0] * 300, pa.int8())), {}, "label column 'label' holds only 0 in "),
        (dict(label=pa.array([True] * 300)), {}, "label column 'label' holds only 1 in "),
        ({}, dict(dense_columns=["int_*"], num_dense_features=2), "--dense_columns int_* matches 3 columns"),
        (
            {},
            dict(dense_columns=["int_*"], sparse_columns=["cat_*"], num_dense_features=2),
            "day_0.parquet, --dense_columns int_* matches 3 columns but --num_dense_features is 2 and --sparse_columns "
            "cat_* matches 4 columns but --num_sparse_features is 26: give --num_dense_features 3 --num_sparse_features 4",
        ),
        ({}, dict(sparse_columns=["nope_*"]), "--sparse_columns nope_* matches no column"),
        (
            {"I1": pa.array(np.ones(300)), "C1": pa.array(np.ones(300, np.int32))},
            dict(dense_columns=["I_*"]),
            "fix the pattern (these are NVTabular/Merlin's Criteo columns: --dense_columns 'I*' --sparse_columns 'C*'",
        ),
        ({}, dict(sparse_columns=["cat_0", "int_0"]), "int_0 would be read twice"),
    ],
)
def test_bad_inputs_are_refused_at_start_naming_file_and_column(tmp_path, change, kwargs, fragment):
    data = table(0, 300)
    for name, column in change.items():
        if column is None:
            data = data.drop_columns([name])
        elif name in data.column_names:
            data = data.set_column(data.schema.get_field_index(name), name, column)
        else:
            data = data.append_column(name, column)
    folder = write_one(tmp_path, "bad", data)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        dataset(folder, eval_fraction=0.5, **kwargs)


@pytest.mark.unit
@pytest.mark.parametrize(
    "change, statistics, fragment",
    [
        (dict(cat_0=pa.array(np.r_[np.zeros(299, np.int64), -4])), False, "column 'cat_0' holds id -4 (row group 0)"),
        (dict(label=pa.array([1.0] * 299 + [0.5])), False, "label column 'label' holds 0.5 (row group 0)"),
        (dict(label=pa.array([0.0, 1.0] * 149 + [1.0, np.nan])), True, "label column 'label' holds nan (row group 0)"),
    ],
)
def test_bad_values_that_statistics_do_not_show_stop_reading_naming_the_file(tmp_path, change, statistics, fragment):
    """Files written without statistics, and what statistics never show (a label between 0 and
    1, NaN, which they leave out of min and max), are checked as their rows are read."""
    data = table(0, 300, **change)
    source = dataset(write_one(tmp_path, "nostats", data, write_statistics=statistics), eval_fraction=0.5)
    with pytest.raises(ConfigError, match=re.escape(f"day_0.parquet: {fragment}")):
        list(source.eval_batches("test", 0))


@pytest.mark.unit
def test_a_garbled_data_page_stops_reading_naming_file_and_row_group(tmp_path):
    folder = write_one(tmp_path, "garbled", table(0, 300), row_group_size=100)
    path = os.path.join(folder, "day_0.parquet")
    chunk = pq.read_metadata(path).row_group(2).column(5)  # cat_0 of the test split's rows
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    with open(path, "r+b") as f:  # the page header: what a torn or corrupted write leaves
        f.seek(start)
        f.write(b"\xff" * 16)
    source = dataset(folder, eval_fraction=0.5)  # the footer is intact: start-up cannot tell
    with pytest.raises(ConfigError, match=r"day_0.parquet: row group 2 cannot be decoded \(.+\): the file is"):
        list(source.eval_batches("test", 0))


@pytest.mark.unit
def test_missing_and_foreign_inputs_are_refused(tmp_path, folder):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(ConfigError, match="holds no Parquet file"):
        dataset(tmp_path / "empty")
    with pytest.raises(ConfigError, match="holds no Parquet file"):
        dataset(f"{folder}/*.csv")
    with pytest.raises(ConfigError, match="does not exist"):
        dataset(tmp_path / "nowhere")
    (tmp_path / "notes.parquet").write_text("not parquet at all")
    with pytest.raises(ConfigError, match=r"notes.parquet is not a readable Parquet file \(it does not end in PAR1\)"):
        dataset(tmp_path / "notes.parquet")
    other = tmp_path / "mixed"
    other.mkdir()
    pq.write_table(table(0, 300), other / "day_0.parquet")
    pq.write_table(table(300, 300, cat_1=pa.array([[1]] * 300)), other / "day_1.parquet")
    with pytest.raises(ConfigError, match="day_1.parquet: column 'cat_1' holds lists of integers, but integers in"):
        dataset(other)
    with pytest.raises(ConfigError, match="fewer than one batch per rank"):
        dataset(folder, batch_size=3000)


@pytest.mark.unit
def test_symlinked_files_are_read_as_the_files_they_name(tmp_path, folder):
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in os.listdir(folder):  # a mix, as a folder assembled from several exports may be
        if name < "day_3":
            (linked / name).symlink_to(os.path.join(folder, name))
        else:
            shutil.copy(os.path.join(folder, name), linked)
    for path in (linked, f"{linked}/day_*.parquet"):
        source = dataset(path)
        assert source.splits == dataset(folder).splits
        assert [rows_of(b) for b in take(source.train_batches(0), 3)] == [
            rows_of(b) for b in take(dataset(folder).train_batches(0), 3)
        ]
    (linked / "day_9.parquet").symlink_to(tmp_path / "gone.parquet")
    with pytest.raises(ConfigError, match=r"day_9.parquet is a symlink to .*gone.parquet, which does not exist"):
        dataset(linked)
    (linked / "day_9.parquet").unlink()
    (linked / "day_9.parquet").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"day_9.parquet is a symlink to the folder .*, which --data_path does not"):
        dataset(linked)


@pytest.mark.unit
def test_a_glob_selects_files_and_the_feature_counts_follow_the_columns(folder):
    data = dataset(f"{folder}/day_[0-2].parquet", eval_fraction=0.5)
    assert [os.path.basename(f.url) for f in data.files] == ["day_0.parquet", "day_1.parquet", "day_2.parquet"]
    assert data.splits["test"][1] == 2150
    cfg = train_config(data="parquet", data_path=folder, dense_columns=["int_0"], sparse_columns=["cat_0", "cat_1"])
    assert (cfg.model.num_dense_features, cfg.model.num_sparse_features) == (1, 2)
    with pytest.raises(ConfigError, match="--sparse_columns names 2 columns but --num_sparse_features is 5"):
        train_config(data="parquet", data_path=folder, sparse_columns=["cat_0", "cat_1"], num_sparse_features=5)
    with pytest.raises(ConfigError) as both:  # every wrong count in one message
        train_config(data="parquet", data_path=folder, dense_columns=["int_0"], sparse_columns=["cat_0"],
                     num_dense_features=3, num_sparse_features=5)  # fmt: skip
    assert str(both.value) == (
        "--dense_columns names 1 columns but --num_dense_features is 3: drop --num_dense_features (the columns set "
        "it) or name 3 columns; --sparse_columns names 1 columns but --num_sparse_features is 5: drop "
        "--num_sparse_features (the columns set it) or name 5 columns"
    )


def make_bucket(name: str) -> None:
    import boto3

    boto3.client("s3").create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})


def test_s3_batches_equal_local_ones_and_resume_exactly(aws, folder):
    make_bucket("clicks")
    s3 = fsspec.filesystem("s3")
    for name in os.listdir(folder):
        s3.put(os.path.join(folder, name), f"clicks/logs/{name}")
    s3.touch("clicks/logs/_SUCCESS")  # Spark's marker is not data
    local = [rows_of(b) for b in take(dataset(folder, 0, 2).train_batches(0), 12)]
    remote = dataset("s3://clicks/logs/", 0, 2)
    assert [rows_of(b) for b in take(remote.train_batches(0), 12)] == local
    assert [rows_of(b) for b in take(dataset("s3://clicks/logs/", 0, 2).train_batches(9), 3)] == local[9:]
    with pytest.raises(ConfigError, match="s3://clicks/logs/day_0.parquet has no column 'cat_9'"):
        dataset("s3://clicks/logs/", sparse_columns=["cat_9"])


def test_training_from_s3_resumes_exactly_where_it_stopped(aws, tmp_path):
    make_bucket("clicks")
    write_files(fsspec.filesystem("s3"), "clicks/train", rows_per_file=[3000, 3000, 2000], group_rows=500)
    common = [
        "-m",
        "apps.dlrm.train",
        "--data",
        "parquet",
        "--data_path",
        "s3://clicks/train",
        "--dense_columns",
        ",".join(DENSE),
        "--sparse_columns",
        ",".join(SPARSE),
        "--categorical_ids",
        "as_is",
        "--shuffle_buffer_rows",
        "1000",
        *tiny(batch_size=128, steps=24, log_every=12, val_batches=2, test_batches=2),
    ]

    def train(name: str, *args: str) -> dict:
        result = run([sys.executable, *common, "--output_dir", str(tmp_path / name), *args], timeout=300)
        assert_ok(result)
        return json.loads((tmp_path / name / "summary.json").read_text())

    reference = train("uninterrupted")
    checkpoints = str(tmp_path / "ckpt")
    stopped = train("first", "--steps", "12", "--checkpoint_dir", checkpoints)
    resumed = train("second", "--checkpoint_dir", checkpoints)
    assert stopped["steps"] == 12 and resumed["resumed_from_step"] == 12 and resumed["steps"] == 24
    assert resumed["final_train_loss"] == reference["final_train_loss"]  # bit for bit
    assert resumed["val_auroc"] == reference["val_auroc"]


@pytest.mark.unit
def test_empty_files_are_not_days_of_the_held_out_split():
    """Spark writes empty part files: one last in name order held out nothing before."""
    assert held_out_split([2000, 2000, 0], 1, 0.5, "d") == held_out_split([2000, 2000], 1, 0.5, "d")


@pytest.mark.unit
@pytest.mark.parametrize(
    "file_rows, eval_fraction, fix",
    [
        ([2000], 0.0005, "hold out more: raise --eval_fraction or --eval_days"),
        ([2000], 1.0, "hold out fewer: lower --eval_fraction below 1 or --eval_days, or add files"),
    ],
)
def test_a_split_without_rows_names_the_options_that_fix_it(file_rows, eval_fraction, fix):
    with pytest.raises(ConfigError, match=re.escape(fix)):
        held_out_split(file_rows, 1, eval_fraction, "d", files="files", more="add files")


@pytest.mark.unit
def test_the_columns_a_checkpoints_model_trained_on_are_fed_in_its_order_or_refused_naming_them():
    def spec(dense, sparse):  # sparse: (name, list, text) each
        return ColumnSpec("label", dense, [s[0] for s in sparse], [s[1] for s in sparse], [s[2] for s in sparse])

    user, items, hour = ("user", False, True), ("items", True, False), ("hour", False, False)
    trained = spec(["f_0", "f_1", "f_2"], [user, items, hour])
    assert spec(["f_2", "f_0", "f_1"], [hour, user, items]).ordered_as(trained, "ckpt/step_8") == trained
    with pytest.raises(ConfigError) as refused:
        spec(["f_2", "f_0", "f_9"], [hour, user, items]).ordered_as(trained, "ckpt/step_8")
    assert str(refused.value).startswith(
        "the model of ckpt/step_8 trained on the dense columns f_0, f_1, f_2, but --dense_columns f_2, f_0, f_9 name "
        "other ones (not trained on: f_9; not named: f_1): give the columns it trained on (in any order)"
    )
    with pytest.raises(ConfigError, match="sparse column 'items' holds single integer ids here, but the model of "
                       "ckpt/step_8 trained on lists of integer ids there \\(sparse feature 2\\)"):  # fmt: skip
        spec(["f_0", "f_1", "f_2"], [hour, user, ("items", False, False)]).ordered_as(trained, "ckpt/step_8")
