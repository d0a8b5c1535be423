"""Criteo preprocessing on generated click logs: every bad kind, the layout, resume, bad input."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from apps.core.common.errors import ConfigError
from apps.dlrm.data.criteo.config import PreprocessConfig, parse_preprocess_config
from apps.dlrm.data.criteo.layout import NpyAppender, open_folder
from apps.dlrm.data.criteo.pipeline import PreprocessFailed, preprocess
from apps.dlrm.data.criteo.sources import find_sources
from testing.criteo_files import (
    BAD_CATEGORICALS,
    BAD_INTEGERS,
    BAD_LINES,
    expected_dense,
    generate_day,
    write_day,
)
from testing.moto_server import REGION
from tests.conftest import REPO, assert_ok, process_env, run, tiny

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

SIZES = [1000] * 26
SIZES[5] = 3  # a tiny table, like Criteo's C6


def config(inputs, output, **kwargs) -> PreprocessConfig:
    return PreprocessConfig(input=inputs, output=str(output), num_embeddings_per_feature=SIZES, workers=2, **kwargs)


@pytest.fixture(scope="module")
def three_days(tmp_path_factory):
    """Three generated days in the three shapes a file comes in, and their preprocessed folder."""
    folder = tmp_path_factory.mktemp("criteo")
    days = [generate_day(1500, seed) for seed in range(3)]
    write_day(days[0], folder / "day_0")
    write_day(days[1], folder / "day_1.gz", compress=True, newline="\r\n")
    write_day(days[2], folder / "day_2.tsv", final_newline=False)
    output = tmp_path_factory.mktemp("out")
    report = preprocess(config([str(folder)], output))
    return days, folder, output, report


def test_every_bad_kind_is_counted_and_every_kept_line_is_exact(three_days):
    days, _, output, report = three_days
    for i, day in enumerate(days):
        name = f"day_{i}"
        labels, ints, cats = day.arrays()
        day_report = report["days"][name]
        assert day_report["rows_read"] == len(day.lines)
        assert day_report["rows_written"] == day.rows_written
        assert day_report["skipped"] == {kind: day.skipped[kind] for kind in BAD_LINES}
        assert day_report["repaired"] == {k: day.repaired[k] for k in ("bad_integer", "bad_categorical")}
        assert all(day_report["skipped"].values()) and all(day_report["repaired"].values())
        dense = np.load(output / f"{name}_dense.npy")
        sparse = np.load(output / f"{name}_sparse.npy")
        label_file = np.load(output / f"{name}_labels.npy")
        assert dense.dtype == np.float32 and dense.shape == (day.rows_written, 13)
        assert sparse.dtype == np.int32 and sparse.shape == (day.rows_written, 26)
        assert label_file.dtype == np.int32 and label_file.shape == (day.rows_written, 1)
        np.testing.assert_array_equal(label_file[:, 0], labels)
        np.testing.assert_array_equal(sparse, cats % np.array(SIZES, dtype=np.uint32))
        np.testing.assert_allclose(dense, expected_dense(ints), rtol=3e-7, atol=0)
    total = {kind: sum(d.skipped[kind] for d in days) for kind in BAD_LINES}
    assert report["skipped"] == total
    assert report["rows_read"] == sum(len(d.lines) for d in days)
    assert report["rows_written"] == sum(d.rows_written for d in days)
    assert json.loads((output / "report.json").read_text()) == report
    assert set(report["policy"]) == set(BAD_LINES) | {"bad_integer", "bad_categorical"}


def test_each_bad_field_alone_is_repaired_as_missing(tmp_path):
    good = generate_day(3, seed=7, malformed=False)
    int_4, cat_6 = 1 + 4, 1 + 13 + 6  # field positions of integer feature 4, categorical 6
    lines = []
    for text in BAD_INTEGERS:
        fields = good.lines[0].split("\t")
        fields[int_4] = text
        lines.append("\t".join(fields))
    for text in BAD_CATEGORICALS:
        fields = good.lines[1].split("\t")
        fields[cat_6] = text
        lines.append("\t".join(fields))
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    report = preprocess(config([str(tmp_path / "day_0")], tmp_path / "out"))
    assert report["repaired"] == {"bad_integer": len(BAD_INTEGERS), "bad_categorical": len(BAD_CATEGORICALS)}
    ints = good.arrays()[1]
    dense = np.load(tmp_path / "out" / "day_0_dense.npy")
    assert (dense[: len(BAD_INTEGERS), 4] == 0).all()  # the bad field: missing
    np.testing.assert_allclose(dense[0, :4], expected_dense(ints[:1, :4])[0], rtol=3e-7)
    sparse = np.load(tmp_path / "out" / "day_0_sparse.npy")
    assert (sparse[len(BAD_INTEGERS) :, 6] == 0).all()
    np.testing.assert_array_equal(sparse[len(BAD_INTEGERS) :, 7], good.arrays()[2][1, 7] % SIZES[7])


def test_empty_and_all_bad_files_are_days_without_rows(tmp_path):
    (tmp_path / "day_0").write_bytes(b"")
    (tmp_path / "day_1.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "day_2").write_text("1\t2\t3\n\n")  # one short line, one empty line
    report = preprocess(config([str(tmp_path / "day_*")], tmp_path / "out"))
    assert report["rows_written"] == 0
    assert report["days"]["day_2"]["skipped"] == {
        "undecodable": 0,
        "empty_line": 1,
        "wrong_column_count": 1,
        "bad_label": 0,
    }
    assert np.load(tmp_path / "out" / "day_1_sparse.npy").shape == (0, 26)


def test_rerun_skips_complete_days_and_redoes_incomplete_ones(three_days, tmp_path):
    _, folder, _, _ = three_days
    output = tmp_path / "out"
    preprocess(config([str(folder)], output))
    mtimes = {p: os.stat(output / p).st_mtime_ns for p in os.listdir(output)}
    os.remove(output / "day_1_report.json")  # as if killed before day_1 was complete
    (output / ".day_1_dense.npy.999.tmp").write_bytes(b"partial")  # a killed worker's leftovers
    report = preprocess(config([str(folder)], output))
    for name in ("day_0_dense.npy", "day_2_sparse.npy", "day_0_report.json"):
        assert os.stat(output / name).st_mtime_ns == mtimes[name], name  # not rewritten
    assert os.stat(output / "day_1_sparse.npy").st_mtime_ns != mtimes["day_1_sparse.npy"]
    assert report["incomplete_days"] == [] and len(report["days"]) == 3


def test_vocabulary_rerun_resumes_and_refuses_other_inputs(three_days, tmp_path):
    _, folder, _, _ = three_days
    inputs = [str(folder / "day_0"), str(folder / "day_1.gz")]
    output = tmp_path / "out"
    first = preprocess(config(inputs, output, categorical_ids="vocabulary"))
    os.remove(output / "day_1_report.json")  # killed after the vocabulary, before day_1's ids
    sparse = np.load(output / "day_1_sparse.npy")
    os.remove(output / "day_1_sparse.npy")
    assert preprocess(config(inputs, output, categorical_ids="vocabulary")) == first
    np.testing.assert_array_equal(np.load(output / "day_1_sparse.npy"), sparse)
    with pytest.raises(ConfigError, match="every day depends on all inputs"):
        preprocess(config([str(folder)], output, categorical_ids="vocabulary"))


def test_a_corrupt_file_fails_alone_and_names_itself(three_days, tmp_path):
    _, folder, _, _ = three_days
    data = (folder / "day_1.gz").read_bytes()
    (tmp_path / "day_1.gz").write_bytes(data[: len(data) // 2])  # a download cut short
    inputs = [str(folder / "day_0"), str(tmp_path / "day_1.gz")]
    with pytest.raises(PreprocessFailed) as failed:
        preprocess(config(inputs, tmp_path / "out"))
    assert "day_1.gz" in str(failed.value) and "1 of 2 input files failed" in str(failed.value)
    assert sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("day_1")) == []
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["incomplete_days"] == ["day_1"] and "day_0" in report["days"]
    (tmp_path / "day_1.gz").write_bytes(data)  # downloaded again: the rerun finishes the job
    assert preprocess(config(inputs, tmp_path / "out"))["incomplete_days"] == []


@pytest.mark.unit
def test_outputs_of_other_settings_or_origin_are_never_overwritten(three_days, tmp_path):
    _, folder, output, _ = three_days
    with pytest.raises(ConfigError, match="other settings.*num_embeddings_per_feature"):
        preprocess(PreprocessConfig(input=[str(folder)], output=str(output), num_embeddings=5))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "day_0_dense.npy").write_bytes(b"someone else's")
    with pytest.raises(ConfigError, match="not written by this preprocessing"):
        preprocess(config([str(folder / "day_0")], foreign))
    assert (foreign / "day_0_dense.npy").read_bytes() == b"someone else's"
    with pytest.raises(ConfigError, match="is the folder of the input"):
        preprocess(config([str(folder)], folder))


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(input=[]), "--input is missing"),
        (dict(output=""), "--output is missing"),
        (dict(output="s3://bucket/out"), "is a URL"),
        (dict(num_embeddings_per_feature=[5, 6]), "has 2 entries"),
        (dict(num_embeddings=2**31), "out of range"),
        (dict(table_size_preset="mlperf", num_embeddings_per_feature=[7] * 26), "give only one"),
        (dict(categorical_ids="bloom"), "--categorical_ids 'bloom'"),
        (dict(workers=-1), "--workers -1"),
    ],
)
def test_bad_options_name_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        PreprocessConfig(**{"input": ["x"], "output": "/tmp/out", **kwargs})


@pytest.mark.unit
def test_inputs_are_found_in_natural_day_order(tmp_path):
    for name in ("day_10.gz", "day_2.gz", "day_1.gz", ".hidden"):
        (tmp_path / name).write_bytes(b"")
    assert [s.day for s in find_sources([str(tmp_path)])] == ["day_1", "day_2", "day_10"]
    assert [s.day for s in find_sources([f"file://{tmp_path}/day_1*"])] == ["day_1", "day_10"]
    with pytest.raises(ConfigError, match="does not exist"):
        find_sources([str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="matches no file"):
        find_sources([str(tmp_path / "*.tsv")])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "day_1.tsv").write_bytes(b"")
    with pytest.raises(ConfigError, match="would both become day 'day_1'"):
        find_sources([str(tmp_path), str(tmp_path / "sub")])


@pytest.mark.unit
def test_streamed_npy_files_are_numpy_files(tmp_path):
    for rows in (0, 5):
        writer = NpyAppender(str(tmp_path / f"a{rows}.npy"), np.dtype("<i4"), 3)
        if rows:
            writer.append(np.arange(rows * 3, dtype=np.int32).reshape(rows, 3))
        assert not os.path.exists(tmp_path / f"a{rows}.npy")  # not under its name until complete
        writer.commit()
        np.testing.assert_array_equal(np.load(tmp_path / f"a{rows}.npy"), np.arange(rows * 3).reshape(rows, 3))


def test_reads_from_s3(aws, three_days, tmp_path):
    import boto3
    import fsspec

    days, folder, output, _ = three_days
    boto3.client("s3").create_bucket(Bucket="criteo-raw", CreateBucketConfiguration={"LocationConstraint": REGION})
    fs = fsspec.filesystem("s3")
    fs.put(str(folder / "day_1.gz"), "criteo-raw/logs/day_1.gz")
    report = preprocess(config(["s3://criteo-raw/logs/"], tmp_path / "out"))
    assert report["days"]["day_1"]["rows_written"] == days[1].rows_written
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "day_1_sparse.npy"), np.load(output / "day_1_sparse.npy"))


def test_command_line_exit_codes(three_days, tmp_path):
    days, folder, _, _ = three_days

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "apps.dlrm.preprocess", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=process_env(),
        )

    ok = run("--input", str(folder / "day_0"), "--output", str(tmp_path / "out"), "--num_embeddings", "50")
    assert ok.returncode == 0, ok.stderr
    assert f"day_0: {len(days[0].lines):,} rows read" in ok.stderr and "wrote" in ok.stderr
    bad = run("--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out2"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    usage = run("--input", "x", "--output", str(tmp_path / "o"), "--categorical_ids", "bloom")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


@pytest.mark.unit
def test_command_line_and_dataclass_agree():
    cfg = parse_preprocess_config(["--input", "a,b", "--output", "o", "--table_size_preset", "mlperf"])
    assert cfg.input == ["a", "b"] and cfg.table_sizes[0] == 40_000_000


@pytest.mark.unit
def test_value_counts_are_exact_across_counting_chunks(monkeypatch, tmp_path):
    from apps.dlrm.data.criteo import vocabulary

    monkeypatch.setattr(vocabulary, "_CHUNK_ROWS", 100)  # many chunks, merged as they come
    rng = np.random.default_rng(0)
    cats = rng.integers(0, 40, size=(26, 1000)).astype(np.uint32)
    counter = vocabulary.ValueCounter()
    for start in range(0, 1000, 70):
        counter.add(cats[:, start : start + 70])
    counter.save(str(tmp_path / "counts.npz"))
    saved = np.load(tmp_path / "counts.npz")
    for f in (0, 25):
        values, first, counts = np.unique(cats[f], return_index=True, return_counts=True)
        np.testing.assert_array_equal(saved[f"values_{f}"], values)
        np.testing.assert_array_equal(saved[f"counts_{f}"], counts)
        np.testing.assert_array_equal(saved[f"first_{f}"], first)


@pytest.mark.parametrize("categorical_ids", ["hash", "vocabulary"])
def test_parquet_output_holds_the_npy_values_row_for_row(three_days, tmp_path, categorical_ids):
    _, folder, npy, _ = three_days
    inputs = [str(folder / "day_0"), str(folder / "day_1.gz")]
    if categorical_ids == "vocabulary":  # ids depend on all inputs: the npy folder of these two
        npy = tmp_path / "npy"
        preprocess(config(inputs, npy, categorical_ids=categorical_ids))
    out = tmp_path / "parquet"
    report = preprocess(config(inputs, out, categorical_ids=categorical_ids, output_format="parquet"))
    assert not [name for name in os.listdir(out) if name.endswith(".npy")]  # the arrays became Parquet
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["output_format"] == "parquet" and set(manifest["files"]) == {
        "day_0.parquet",
        "day_0_report.json",
        "day_1.parquet",
        "day_1_report.json",
    }
    for day in ("day_0", "day_1"):
        table = pq.read_table(out / f"{day}.parquet")
        assert table.schema.names == ["label", *(f"int_{j}" for j in range(13)), *(f"cat_{j}" for j in range(26))]
        assert table.num_rows == report["days"][day]["rows_written"]
        np.testing.assert_array_equal(table["label"].to_numpy(), np.load(npy / f"{day}_labels.npy")[:, 0])
        dense = np.stack([table[f"int_{j}"].to_numpy() for j in range(13)], axis=1)
        np.testing.assert_array_equal(dense, np.load(npy / f"{day}_dense.npy"))  # same float32 bits
        sparse = np.stack([table[f"cat_{j}"].to_numpy() for j in range(26)], axis=1)
        np.testing.assert_array_equal(sparse, np.load(npy / f"{day}_sparse.npy"))
    with pytest.raises(ConfigError, match="other settings.*output_format"):
        preprocess(config(inputs, out, categorical_ids=categorical_ids))  # npy into the Parquet folder


def test_training_on_the_parquet_output(three_days, tmp_path):
    _, folder, _, _ = three_days
    out = tmp_path / "parquet"
    preprocess(config([str(folder)], out, output_format="parquet"))
    with pytest.raises(ConfigError, match="holds Parquet days.*--data parquet"):
        open_folder(str(out))
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            "--data",
            "parquet",
            "--data_path",
            str(out),
            "--categorical_ids",
            "as_is",
            "--num_embeddings_per_feature",
            ",".join(map(str, SIZES)),
            *tiny(batch_size=128, steps=60, epochs=5, val_batches=0, test_batches=0),
            "--output_dir",
            str(tmp_path / "train"),
        ],
        timeout=300,
    )
    assert_ok(result)
    assert f"parquet {out}: 3 files" in result.stderr
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["config"]["data"] == "parquet"
    # Clicks follow categorical feature 0 and integer feature 0 (testing/criteo_files.py): a model fed
    # each row's own features and label learns them; misaligned columns would give 0.5.
    assert summary["val_auroc"] > 0.6, summary  # 0.66
