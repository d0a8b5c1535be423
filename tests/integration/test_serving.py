"""After training: train -> export -> predict as a user runs them, three ``torchx run`` commands on
local_cwd, and what their results must be.

Once per module: Parquet click logs that a DLRM learns (testing/click_parquet.py; their dense
values raw counts, which training reads through ``--dense_transform log1p``, and one sparse column
text ids, which it fingerprints), a sharded
training run on two ranks that keeps its best checkpoint and tests it, its float32 package
(``components.dlrm:export``), its int8 package, predictions of every row by the float32 package on
two ranks (``components.dlrm:predict``), and the training job's own per-row scores of its test
split (its sharded model and evaluation loop: testing/training_scores.py).
"""

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchx.runner import get_runner
from torchx.schedulers import get_scheduler_factories

from apps.core.common.errors import ConfigError
from apps.dlrm.data.criteo.config import PreprocessConfig
from apps.dlrm.data.criteo.parse import LineCounts
from apps.dlrm.data.criteo.pipeline import preprocess as preprocess_days
from apps.dlrm.data.criteo.vocabulary import RARE_ID
from apps.dlrm.data.parquet.files import ColumnSpec
from apps.dlrm.serving.api import load_model
from apps.dlrm.serving.config import ExportConfig
from apps.dlrm.serving.criteo_tsv import Block, CriteoIds
from apps.dlrm.serving.export import export
from apps.dlrm.serving.features import Features
from apps.dlrm.serving.package import MANIFEST_FILE
from components import dlrm
from testing.click_parquet import scores_auroc, write_click_parquet
from testing.criteo_files import generate_day, write_day
from tests.conftest import BIN, LOCAL_TRAIN_1X2, REPO, assert_ok, process_env, run

# Tier (tests/conftest.py): real processes; the component dry runs are marked unit.
TIER = "integration"

ROWS_PER_FILE = 4096
FILES = 4
#: The test split: the second half of the last file (--eval_days 1), as row ids.
TEST_ROWS = np.arange((FILES - 1) * ROWS_PER_FILE + ROWS_PER_FILE // 2, FILES * ROWS_PER_FILE)
MODEL = ["--num_embeddings", "2000", "--batch_size", "256"]
TORCHX = os.path.join(BIN, "torchx")


def torchx_run(component: str, *args: str) -> subprocess.CompletedProcess:
    result = run([TORCHX, "run", "-s", "local_cwd", component, *args])
    assert_ok(result)
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    paths = SimpleNamespace(**{name: str(root / name) for name in ("data", "ckpt", "out", "fp32", "int8", "scores")})
    write_click_parquet(paths.data, files=FILES, rows_per_file=ROWS_PER_FILE, dense_counts=True, text_columns=(0,))
    data = ["--data", "parquet", "--data_path", paths.data]
    train = [
        *data,
        *MODEL,
        "--dense_transform",
        "log1p",
        "--val_batches",
        "0",
        "--test_batches",
        "0",
        "--checkpoint_dir",
        paths.ckpt,
    ]
    assert_ok(run([*LOCAL_TRAIN_1X2, *train, "--output_dir", paths.out]))
    torchx_run("components.dlrm:export", "--checkpoint_dir", paths.ckpt, "--step", "best", "--output", paths.fp32)
    export(ExportConfig(checkpoint_dir=paths.ckpt, output=paths.int8, quantize="int8"))
    predicted = torchx_run(
        "components.dlrm:predict", "-j", "1x2", "--model", paths.fp32, *data, "--output", paths.scores,
        "--passthrough_columns", "row_id,label",
    )  # fmt: skip
    own = str(root / "own.npz")
    evaluation = [*train, "--output_dir", "", "--evaluate_checkpoint", "best"]
    assert_ok(run([sys.executable, "-m", "testing.training_scores", "--out", own, *evaluation]))
    return SimpleNamespace(
        **vars(paths),
        summary=json.loads((root / "out" / "summary.json").read_text()),
        own=np.load(own),
        predict_log=predicted.stdout + predicted.stderr,
    )


def predictions(folder: str) -> pa.Table:
    """Every prediction of ``folder``, in row id order."""
    tables = [
        pq.read_table(os.path.join(folder, name)) for name in sorted(os.listdir(folder)) if name.endswith(".parquet")
    ]
    table = pa.concat_tables(tables)
    return table.take(np.argsort(table["row_id"].to_numpy()))


def manifest(package: str) -> dict:
    with open(os.path.join(package, MANIFEST_FILE)) as f:
        return json.load(f)


def test_the_float32_package_scores_the_test_split_as_the_training_job_did(job):
    scores = predictions(job.scores)
    assert scores["row_id"].to_numpy().tolist() == list(range(FILES * ROWS_PER_FILE))
    test = scores.take(TEST_ROWS)
    package_scores = test["score"].to_numpy()
    assert np.abs(package_scores - job.own["scores"]).max() <= 1e-5  # row for row, the sharded model's own
    assert abs(scores_auroc(package_scores, test["label"].to_numpy()) - job.summary["test_auroc"]) <= 1e-4
    assert job.summary["test_auroc"] > 0.6  # the model learned something to be equal to
    report = json.loads(open(os.path.join(job.scores, "report.json")).read())
    assert (report["world_size"], report["rows_read"], report["rows_scored"]) == (2, 16384, 16384)
    assert report["rows_skipped"] == {} and len(report["files"]) == FILES
    assert report["source"] == manifest(job.fp32)["source"]
    assert "scored 16,384 rows of 4 files (0 skipped)" in job.predict_log
    for file in report["files"]:  # every rank's files, though only rank 0 logs
        assert f"scored {file['input']}: {file['rows_scored']:,} rows -> {file['output']}" in job.predict_log
    assert "rank 0 scored" in job.predict_log and "rank 1 scored" in job.predict_log


def test_the_int8_package_is_smaller_and_ranks_the_rows_nearly_alike(job):
    tables = manifest(job.int8)["tables"]
    assert tables["quantize"] == "int8" and tables["trained_bytes"] / tables["package_bytes"] >= 1.9
    rows = pq.read_table(job.data).take(TEST_ROWS)
    labels = rows["label"].to_numpy()
    fp32, int8 = load_model(job.fp32)(rows), load_model(job.int8)(rows)
    assert abs(scores_auroc(int8, labels) - scores_auroc(fp32, labels)) <= 0.005


def test_load_model_scores_columns_in_any_form_as_predict_did(job):
    rows = pq.read_table(job.data).take(TEST_ROWS)
    expected = predictions(job.scores).take(TEST_ROWS)["score"].to_numpy()
    package = load_model(job.fp32)
    columns = {name: rows[name].to_numpy() for name in reversed(rows.column_names)}  # any order
    frame = pd.DataFrame(columns, index=TEST_ROWS)  # an index of its own, which is no column
    for given in (rows, columns, frame, pa.Table.from_batches(rows.to_batches()).combine_chunks().to_batches()[0]):
        assert np.array_equal(package(given), expected)
    assert np.array_equal(load_model(job.ckpt, step="best")(rows), expected)  # straight from the checkpoint
    assert np.abs(package(rows.slice(5, 1)) - expected[5:6]).max() <= 1e-6  # one row alone: beside an empty one


def test_load_model_scores_an_empty_batch_to_nothing_and_decimal_columns_as_numbers(job, caplog):
    rows = pq.read_table(job.data).take(TEST_ROWS[:200])
    package = load_model(job.fp32)
    expected = package(rows)
    for empty in (rows.slice(0, 0), pd.DataFrame(columns=rows.column_names), {}):  # an empty frame's types: null
        scores = package(empty)
        assert scores.dtype == np.float32 and scores.shape == (0,)
    numeric = pa.decimal128(38, 6)  # BigQuery's NUMERIC, Spark's DecimalType
    as_decimal = rows.set_column(rows.schema.get_field_index("int_0"), "int_0", rows["int_0"].cast(numeric, safe=False))
    assert np.abs(package(as_decimal) - expected).max() <= 1e-6
    with_nan = rows.set_column(rows.schema.get_field_index("int_1"), "int_1", pa.array([np.nan] * 200))
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data"):
        package(with_nan)
    assert "dense column 'int_1' holds NaN or infinite values (row group 0): they are scored as 0" in caplog.text
    assert "train" not in caplog.text  # where they said: they train as 0, ... logged when training ends


#: Scores the package with torch (and TorchRec's operators for quantized tables) alone, from the
#: manifest's description: this project is not importable in the process that runs it.
WITHOUT_THE_PROJECT = """
import json, sys
import numpy as np
import torch
try:
    import apps
except ImportError:
    pass
else:
    sys.exit(f"this process imports the project from {apps.__path__}")
package, inputs, out = sys.argv[1:4]
manifest = json.load(open(f"{package}/manifest.json"))
features = manifest["features"]
if manifest["tables"]["quantize"] != "none":
    import torchrec  # noqa: F401 - registers FBGEMM's table operators
dense, raw = np.load(f"{inputs}/dense.npy"), np.load(f"{inputs}/sparse.npy")
if features["dense_log1p"]:  # the manifest's dense_transform
    dense = np.log1p(np.maximum(dense, 0))


def fnv1a64(text):  # the manifest's id_transform of a text value
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


for k, texts in json.load(open(f"{inputs}/text.json")).items():
    raw[:, int(k)] = [fnv1a64(t) for t in texts]


def splitmix64(x):  # the manifest's id_transform
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


assert features["categorical_ids"] == "hash"
ids = splitmix64(raw) % np.array(features["table_sizes"], dtype=np.uint64)
values = torch.from_numpy(ids.T.reshape(-1).astype(np.int64))  # feature after feature, row after row
lengths = torch.ones(values.numel(), dtype=torch.int32)
program = torch.export.load(f"{package}/{manifest['program']['file']}").module()
np.save(out, program(torch.from_numpy(dense), values, lengths).detach().numpy())
"""


@pytest.mark.parametrize("package", ["fp32", "int8"])
def test_a_package_scores_in_a_process_that_cannot_import_this_project(job, tmp_path, package):
    rows = pq.read_table(job.data).take(TEST_ROWS[:300])
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    columns = manifest(getattr(job, package))["training"]["config"]
    assert columns["dense_columns"] == ["int_*"] and columns["sparse_columns"] == ["cat_*"]
    np.save(inputs / "dense.npy", np.stack([rows[f"int_{j}"].to_numpy() for j in range(13)], axis=1))
    text = {k: rows[f"cat_{k}"].to_pylist() for k in range(26) if pa.types.is_string(rows[f"cat_{k}"].type)}
    assert list(text) == [0]
    (inputs / "text.json").write_text(json.dumps(text))
    ints = [np.zeros(len(rows), np.uint64) if k in text else rows[f"cat_{k}"].to_numpy() for k in range(26)]
    np.save(inputs / "sparse.npy", np.stack(ints, axis=1).astype(np.uint64))
    script = tmp_path / "score.py"
    script.write_text(WITHOUT_THE_PROJECT)
    # -S: no site module, so no .pth file (the venv's editable install of this project is one) adds
    # the repository to sys.path; PYTHONPATH names the installed packages alone.
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": sysconfig.get_paths()["purelib"], "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-S", str(script), getattr(job, package), str(inputs), str(tmp_path / "scores.npy")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    expected = load_model(getattr(job, package))(rows)
    assert np.abs(np.load(tmp_path / "scores.npy") - expected).max() <= 1e-6


def test_a_preprocessed_criteo_folder_and_its_click_logs_score_alike_straight_from_a_checkpoint(tmp_path):
    days = [generate_day(3000, seed=d) for d in range(3)]  # every kind of bad line mixed in
    for d, day in enumerate(days):
        write_day(day, str(tmp_path / f"day_{d}{'.gz' if d == 2 else ''}"), compress=d == 2)
    data, ckpt, out, scores, logs = (str(tmp_path / name) for name in ("npy", "ckpt", "out", "scores", "logs"))
    preprocess = ["--input", str(tmp_path / "day_*"), "--output", data, "--num_embeddings", "2000"]
    assert_ok(run([sys.executable, "-m", "apps.dlrm.preprocess", *preprocess]))
    train = ["--data", "criteo", "--data_path", data, *MODEL, "--checkpoint_dir", ckpt]
    assert_ok(run([sys.executable, "-m", "apps.dlrm.train", *train, "--output_dir", out]))  # one process
    predict = [sys.executable, "-m", "apps.dlrm.predict", "--model", ckpt, "--passthrough_columns", "row,label"]
    assert_ok(run([*predict, "--data", "criteo", "--data_path", data, "--output", scores]))
    last = pq.read_table(os.path.join(scores, "day_2.parquet"))
    assert last["row"].to_numpy().tolist() == list(range(last.num_rows))
    test = last.slice((last.num_rows + 1) // 2)  # the day's second half (--eval_days 1)
    summary = json.loads(open(os.path.join(out, "summary.json")).read())
    assert abs(scores_auroc(test["score"].to_numpy(), test["label"].to_numpy()) - summary["test_auroc"]) <= 1e-4

    # The click logs themselves, their ids made as the training run's folder records (its --data_path).
    assert_ok(run([*predict, "--data", "criteo_tsv", "--data_path", str(tmp_path / "day_*"), "--output", logs]))
    for d in range(3):
        preprocessed = pq.read_table(os.path.join(scores, f"day_{d}.parquet"))
        assert pq.read_table(os.path.join(logs, f"day_{d}.parquet")).equals(preprocessed)
    report = json.loads(open(os.path.join(logs, "report.json")).read())
    assert report["rows_read"] == sum(len(day.lines) for day in days)
    assert report["rows_scored"] == sum(day.rows_written for day in days)
    assert report["rows_skipped"] == dict(sum((day.skipped for day in days), Counter()))
    assert report["rows_repaired"] == dict(sum((day.repaired for day in days), Counter()))

    elsewhere = ["--preprocessed_path", str(tmp_path), "--output", str(tmp_path / "never")]
    moved = run([*predict, "--data", "criteo_tsv", "--data_path", str(tmp_path / "day_0"), *elsewhere])
    assert moved.returncode == 2
    (line,) = [line for line in moved.stderr.splitlines() if "ERROR" in line]
    assert f"--preprocessed_path {tmp_path} holds no manifest.json" in line and "give --preprocessed_path" in line


def test_click_logs_take_the_ids_of_a_vocabulary_folder_and_new_values_the_rare_id(tmp_path):
    sizes = [50_000] * 26
    sizes[3] = 5
    days = [generate_day(800, seed=d) for d in range(2)]
    for d, day in enumerate(days):
        write_day(day, str(tmp_path / f"day_{d}"))
    folder = str(tmp_path / "vocabulary_ids")
    config = dict(input=[str(tmp_path / "day_*")], output=folder, num_embeddings_per_feature=sizes, workers=1)
    preprocess_days(PreprocessConfig(**config, categorical_ids="vocabulary", frequency_threshold=2))
    ids = CriteoIds(folder, "--preprocessed_path", sizes)
    counts = LineCounts()
    blocks = list(ids.blocks(str(tmp_path / "day_1"), counts, rows=300))
    assert [len(block) for block in blocks] == [300, 300, days[1].rows_written - 600]  # as a day is chunked
    block = Block.join(blocks)
    assert np.array_equal(block.ids, np.load(os.path.join(folder, "day_1_sparse.npy")))
    assert np.array_equal(block.dense, np.load(os.path.join(folder, "day_1_dense.npy")))
    assert not block.unseen.any() and counts.skipped == days[1].skipped

    label, ints, cats = days[1].labels[0], days[1].ints[0], days[1].cats[0]  # its first row kept, as a line
    fields = [str(label), *map(str, ints), "fedcba98", *(f"{value:08x}" for value in cats[1:3]), "fedcba97"]
    (tmp_path / "new").write_text("\t".join([*fields, *(f"{value:08x}" for value in cats[4:])]) + "\n")
    (block,) = ids.blocks(str(tmp_path / "new"), LineCounts(), rows=300)
    assert block.unseen.tolist() == [True] and block.ids[0, 0] == RARE_ID and block.ids[0, 3] == RARE_ID % 5
    assert np.array_equal(block.ids[0, 4:], np.load(os.path.join(folder, "day_1_sparse.npy"))[0, 4:])

    os.remove(os.path.join(folder, "vocabulary", "cat_0_values.npy"))
    with pytest.raises(
        ConfigError, match=r"vocabulary, and has no vocabulary/cat_0_values.npy: .* give --preprocessed_path"
    ):
        CriteoIds(folder, "--preprocessed_path", sizes)


# --- bad input: one line naming the value and the fix, nothing overwritten ---------------------------


def test_an_output_that_holds_predictions_is_refused_and_left_as_it_was(job):
    before = {name: os.path.getmtime(os.path.join(job.scores, name)) for name in os.listdir(job.scores)}
    command = [sys.executable, "-m", "apps.dlrm.predict", "--model", job.int8, "--data_path", job.data]
    result = run([*command, "--output", job.scores])
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert f"--output {job.scores} already holds 5 entries" in line and "give a new --output" in line
    assert before == {name: os.path.getmtime(os.path.join(job.scores, name)) for name in os.listdir(job.scores)}
    with pytest.raises(ConfigError, match=f"--output {job.int8} already holds 2 entries"):
        export(ExportConfig(checkpoint_dir=job.ckpt, output=job.int8))


def predict_command(job, output, *options: str) -> list[str]:
    """One process of predict scoring the job's data with its float32 package into ``output``."""
    return [
        sys.executable, "-m", "apps.dlrm.predict", "--model", job.fp32, "--data_path", job.data,
        "--output", str(output), "--passthrough_columns", "row_id,label", *options,
    ]  # fmt: skip


def test_two_predict_jobs_into_one_output_one_is_refused_and_the_other_writes_it_whole(job, tmp_path):
    """Started at once: the first to claim the folder writes it, the other stops before it reads a row."""
    output = tmp_path / "scores"
    jobs = [
        subprocess.Popen(predict_command(job, output), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=process_env(), cwd=REPO)
        for _ in range(2)
    ]  # fmt: skip
    done = sorted((p.wait(timeout=600), p.communicate()[1]) for p in jobs)
    (ok, _), (refused, stderr) = done
    assert (ok, refused) == (0, 2), done
    (line,) = [line for line in stderr.splitlines() if "ERROR" in line]
    assert f"--output {output} is the output of job " in line and "two jobs never write one --output" in line
    assert sorted(os.listdir(output)) == ["day_0.parquet", "day_1.parquet", "day_2.parquet", "day_3.parquet",
                                          "report.json"]  # fmt: skip
    assert predictions(str(output))["row_id"].to_numpy().tolist() == list(range(FILES * ROWS_PER_FILE))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_predict_onto_a_full_or_read_only_disk_stops_in_one_line_leaving_no_file_half_written(job, tmp_path, disk):
    """The disk is a real one: a tmpfs of 120 KiB, which holds two of the four files' predictions
    (47 KB each), mounted in a mount namespace of the job's own; what is on it is copied out."""
    mounted, kept = tmp_path / "disk", tmp_path / "kept"
    mounted.mkdir()
    output = mounted / "scores"
    options = "size=120k" if disk == "full" else "size=120k,ro"
    script = (
        f"mount -t tmpfs -o {options} tmpfs {mounted} && {{ {shlex.join(predict_command(job, output))}; "
        f"status=$?; cp -a {mounted} {kept}; exit $status; }}"
    )
    result = run(["unshare", "--mount", "sh", "-c", script])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    if disk == "read_only":
        assert f"cannot write {output} (Read-only file system): nothing half-written is kept" in line
        assert os.listdir(kept) == []
        return
    assert f"cannot write {output}/day_2.parquet (No space left on device): nothing half-written is kept" in line
    # The files written before are whole; the output says it is not (no report, the job's claim left).
    assert sorted(os.listdir(kept / "scores")) == [".JOB", "day_0.parquet", "day_1.parquet"]
    for name in ("day_0.parquet", "day_1.parquet"):
        assert pq.read_table(kept / "scores" / name).num_rows == ROWS_PER_FILE


def copy_package(job, tmp_path, change) -> str:
    """A copy of the float32 package with ``change(manifest)`` applied to its manifest."""
    package = str(tmp_path / "package")
    shutil.copytree(job.fp32, package)
    changed = manifest(package)
    change(changed)
    with open(os.path.join(package, MANIFEST_FILE), "w") as f:
        json.dump(changed, f)
    return package


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda m: m.update(format_version=99), "is a package of format version 99, but this version of the project"),
        (lambda m: m["versions"].update(torch="9.1.0"), "was exported with torch 9.1.0, newer than this torch"),
        (lambda m: m["program"].update(sha256="0" * 64), "is not the program its manifest names"),
    ],
)
def test_a_package_of_another_version_or_changed_is_refused(job, tmp_path, change, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_model(copy_package(job, tmp_path, change))


def test_a_folder_that_is_no_package_nor_checkpoint_of_ours_is_refused(job, tmp_path):
    with pytest.raises(ConfigError, match="is neither an inference package .* nor a checkpoint folder"):
        load_model(job.data)
    foreign = tmp_path / "ckpt"
    shutil.copytree(job.ckpt, foreign)
    (step,) = [name for name in os.listdir(foreign) if name.startswith("step_")]
    (foreign / step / "manifest.json").write_text(json.dumps({"step": int(step[5:])}))
    with pytest.raises(ConfigError, match="is not a checkpoint of this project .* records no config and model"):
        load_model(str(foreign), step="latest")


#: The columns the job's model trained on, as its checkpoint and packages record them.
TRAINED_COLUMNS = {
    "dense": [f"int_{j}" for j in range(13)],
    "sparse": [{"name": f"cat_{k}", "ids": "text" if k == 0 else "integer", "list": False} for k in range(26)],
}


def test_the_columns_training_matched_are_recorded_in_the_checkpoint_and_the_package(job):
    (step,) = [name for name in os.listdir(job.ckpt) if name.startswith("step_")]
    assert manifest(os.path.join(job.ckpt, step))["columns"] == TRAINED_COLUMNS
    assert manifest(job.fp32)["features"]["columns"] == manifest(job.int8)["features"]["columns"] == TRAINED_COLUMNS
    assert load_model(job.ckpt).manifest["features"]["columns"] == TRAINED_COLUMNS


def column_as(name: str, arrow_type: pa.DataType):
    """A change of a table: its column ``name`` cast to ``arrow_type``."""
    return lambda rows: rows.set_column(rows.schema.get_field_index(name), name, rows[name].cast(arrow_type))


@pytest.mark.parametrize(
    "change, pieces",
    [
        (
            lambda rows: rows.drop_columns(["cat_5"]),
            ["the columns given has no column 'cat_5', which the model trained on as sparse feature 6 of 26 (cat_0, "],
        ),
        (
            lambda rows: rows.rename_columns(["int_99" if name == "int_12" else name for name in rows.column_names]),
            [
                "has no column 'int_12', which the model trained on as dense feature 13 of 13",
                "its columns the model does not read: row_id, label, int_99: rename the column that holds it to 'int_12'",
            ],
        ),
        (
            column_as("cat_3", pa.string()),
            [
                "the columns given: sparse column 'cat_3' holds text, but the model trained on integers there",
                "cast the column to integers, holding the values training read (e.g. CAST(cat_3 AS BIGINT)",
            ],
        ),
        (
            lambda rows: rows.set_column(rows.schema.get_field_index("cat_0"), "cat_0", pa.array(range(len(rows)))),
            [
                "the columns given: sparse column 'cat_0' holds integers, but the model trained on text there",
                "cast the column to text, holding the values training read (e.g. CAST(cat_0 AS STRING)",
            ],
        ),
        (
            lambda rows: rows.set_column(
                rows.schema.get_field_index("cat_4"), "cat_4", pa.array([[v, v + 1] for v in rows["cat_4"].to_pylist()])
            ),
            [
                "the columns given: sparse column 'cat_4' holds lists of ids, but the model trained on single ids there "
                "(sparse feature 5, column 'cat_4')",
                "give the column of one id per row that training read",
            ],
        ),
    ],
    ids=["missing", "renamed", "text_for_integers", "integers_for_text", "list_for_single_ids"],
)
def test_columns_that_differ_from_those_the_model_trained_on_are_refused_naming_them(job, change, pieces):
    rows = change(pq.read_table(job.data).slice(0, 10))
    for model in (load_model(job.fp32), load_model(job.ckpt)):
        with pytest.raises(ConfigError) as refused:
            model(rows)
        assert all(piece in str(refused.value) for piece in pieces), str(refused.value)
        assert "\n" not in str(refused.value)


def test_predict_refuses_files_without_a_trained_column_and_ignores_extra_ones(job, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = pq.read_table(job.data).take(TEST_ROWS[:500])
    pq.write_table(rows.drop_columns(["cat_7"]), data / "day_0.parquet")
    command = [sys.executable, "-m", "apps.dlrm.predict", "--model", job.fp32, "--data_path", str(data)]
    result = run([*command, "--output", str(tmp_path / "refused")])
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert f"{data / 'day_0.parquet'} has no column 'cat_7', which the model trained on as sparse feature 8" in line
    assert "--num_sparse_features" not in line and not os.path.exists(tmp_path / "refused")

    pq.write_table(rows.append_column("campaign", pa.array(["x"] * len(rows))), data / "day_0.parquet")
    assert_ok(run([*command, "--output", str(tmp_path / "scores"), "--passthrough_columns", "row_id,campaign"]))
    scored = pq.read_table(tmp_path / "scores" / "day_0.parquet")
    assert scored["campaign"].to_pylist() == ["x"] * len(rows)
    assert np.array_equal(scored["score"].to_numpy(), load_model(job.fp32)(rows))  # as without the extra column


def test_a_package_and_a_checkpoint_from_before_the_columns_record_score_by_their_patterns(job, tmp_path):
    package = copy_package(job, tmp_path, lambda m: m["features"].pop("columns"))
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(job.ckpt, checkpoint)
    (step,) = [name for name in os.listdir(checkpoint) if name.startswith("step_")]
    recorded = manifest(str(checkpoint / step))
    del recorded["columns"]
    (checkpoint / step / MANIFEST_FILE).write_text(json.dumps(recorded))
    old_export = str(tmp_path / "old_export")
    export(ExportConfig(checkpoint_dir=str(checkpoint), output=old_export))
    assert manifest(old_export)["features"]["columns"] is None
    rows = pq.read_table(job.data).take(TEST_ROWS)
    expected = predictions(job.scores).take(TEST_ROWS)["score"].to_numpy()
    for old in (package, str(checkpoint), old_export):
        model = load_model(old)
        assert np.array_equal(model(rows), expected)
        with pytest.raises(ConfigError) as refused:  # which column is gone, its patterns cannot tell
            model(rows.drop_columns(["int_4"]))
        assert "the model's --dense_columns int_* matches 12 columns of the columns given" in str(refused.value)
        assert "give the data the columns it trained on" in str(refused.value)
        assert "--num_dense_features" not in str(refused.value)


@pytest.mark.unit
def test_columns_named_at_predict_feed_the_trained_features_in_order_their_ids_of_the_trained_kind():
    trained = {"dense": ["f_0"], "sparse": [{"name": "user", "ids": "text", "list": False}]}
    features = Features("parquet", ["f_*"], ["user"], "hash", [100], 1, columns=ColumnSpec.from_record(trained))
    schema = pa.schema([("x", pa.float32()), ("member", pa.string()), ("member_id", pa.int64())])
    spec = features.spec([("new.parquet", schema)], ["x"], ["member"])
    assert (spec.dense, spec.sparse, spec.text) == (["x"], ["member"], [True])
    with pytest.raises(ConfigError, match="new.parquet: sparse column 'member_id' holds integers, but the model trained "
                       "on text there \\(sparse feature 1, column 'user'\\)"):  # fmt: skip
        features.spec([("new.parquet", schema)], ["x"], ["member_id"])
    with pytest.raises(ConfigError, match="--sparse_columns member\\* matches 2 columns of new.parquet \\(member, "
                       "member_id\\), but the model reads 1 sparse features: name 1 columns"):  # fmt: skip
        features.spec([("new.parquet", schema)], ["x"], ["member*"])


# --- the components, on every scheduler ----------------------------------------------------------

#: What each scheduler needs to render a request without a cluster (as tests/integration/test_dryrun.py gives).
SCHEDULER_CFG = {
    "kubernetes": {"queue": "dlrm", "validate_spec": False},
    "kubeflow": {"queue": "dlrm"},
    "aws_batch": {"queue": "dlrm", "user": "alice"},
}


@pytest.mark.unit
@pytest.mark.parametrize("scheduler", list(get_scheduler_factories()))
def test_export_and_predict_render_on_every_scheduler(scheduler):
    apps = {
        ("apps.dlrm.export", "--quantize", "int8"): dlrm.export(
            checkpoint_dir="s3://b/ckpt", output="s3://b/pkg", quantize="int8"
        ),
        ("apps.dlrm.predict", "--model", "s3://b/pkg", "--nproc_per_node"): dlrm.predict(
            j="2x4", model="s3://b/pkg", data_path="s3://b/c/", output="s3://b/s/"
        ),
    }
    with get_runner() as runner:
        for words, app in apps.items():
            request = str(runner.dryrun(app, scheduler, cfg=SCHEDULER_CFG.get(scheduler, {})).request)
            assert all(word in request for word in words), (words, request)


@pytest.mark.unit
def test_component_arguments_are_checked_before_submission():
    with pytest.raises(ConfigError, match="--quantize 'int4' is not supported: use one of none, fp16, int8"):
        dlrm.export(checkpoint_dir="c", output="o", quantize="int4")
    with pytest.raises(ConfigError, match="--output is missing"):
        dlrm.predict(model="m", data_path="d")
    with pytest.raises(ConfigError, match="--step 'newest': give best, latest or a step number"):
        dlrm.export(checkpoint_dir="c", output="o", step="newest")
    with pytest.raises(ConfigError, match="--preprocessed_path /p is read only with --data criteo_tsv: leave it out"):
        dlrm.predict(model="m", data_path="d", output="o", preprocessed_path="/p")
    with pytest.raises(ConfigError, match="--passthrough_columns row_id,label,row_id names row_id more than once"):
        dlrm.predict(model="m", data_path="d", output="o", passthrough_columns="row_id,label,row_id")
