"""A user's own finite data, trained as ML engineers expect: one epoch by default, validation on
the way into metrics.jsonl, early stopping on data it overfits, and a finished run that has
nothing left to do. The data is Parquet with a planted signal: the synthetic source's samples,
whose labels a hidden teacher drew, written as a user's click logs would be."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apps.dlrm.config import train_config
from tests.conftest import process_env
from tests.unit.test_synthetic import synthetic

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

ROWS_PER_FILE, FILES, TABLE_ROWS = 2048, 6, 2000
#: Only what a user must give: where the data is and which columns are which.
COLUMNS = ["--data", "parquet", "--categorical_ids", "as_is", "--num_embeddings", str(TABLE_ROWS)]
SMALL = ["--batch_size", "128", "--log_every", "8", "--val_batches", "0", "--test_batches", "0"]


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> str:
    """6 Parquet files ("days") of 2048 rows: label, int_0..12, cat_0..25; the last is held out."""
    folder = tmp_path_factory.mktemp("clicks")
    source = synthetic(train_config(num_embeddings=TABLE_ROWS, batch_size=ROWS_PER_FILE))
    for day in range(FILES):
        batch = source.block("train", day)
        ids = batch.sparse_features.to_dict()
        columns = {"label": pa.array(batch.labels.numpy().astype(np.int8))}
        columns.update({f"int_{i}": pa.array(batch.dense_features[:, i].numpy()) for i in range(13)})
        columns.update({f"cat_{i}": pa.array(ids[f"cat_{i}"].values().numpy()) for i in range(26)})
        pq.write_table(pa.table(columns), str(folder / f"day_{day}.parquet"), row_group_size=512)
    return str(folder)


def train(out, clicks: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *COLUMNS,
            "--data_path",
            clicks,
            *SMALL,
            "--output_dir",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=process_env(),
    )


def results(out) -> tuple[dict, list[dict]]:
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return summary, [json.loads(line) for line in f]


def test_a_users_data_trains_one_epoch_and_ends_near_its_best_validation(clicks, tmp_path):
    result = train(tmp_path, clicks, "--val_every_steps", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    # 5 training files of 2048 rows in batches of 128: an epoch is 80 steps, and one is trained
    assert "training steps 1..80: 80 steps of 128 samples: an epoch is 80 steps, so 1 epoch" in result.stderr
    summary, metrics = results(tmp_path)
    assert (summary["steps"], summary["epochs"], summary["stopped_early"]) == (80, 1.0, False)
    val = [m for m in metrics if m["kind"] == "val"]
    assert [m["step"] for m in val] == list(range(8, 81, 8))  # every 8 steps, the last at the end
    assert [m["step"] for m in metrics if m["kind"] == "train"] == list(range(8, 81, 8))
    best = max(m["auroc"] for m in val)
    assert summary["val_auroc"] == val[-1]["auroc"] and best - summary["val_auroc"] < 0.03
    assert summary["best_val_auroc"] == best and val[0]["auroc"] < best  # and it learned
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curves, drawn


def test_many_epochs_stop_early_on_data_they_overfit_and_a_rerun_has_nothing_left(clicks, tmp_path):
    checkpoints, out = tmp_path / "ckpt", tmp_path / "out"
    args = [
        "--epochs",
        "20",
        "--early_stopping_patience",
        "2",
        "--checkpoint_dir",
        str(checkpoints),
        "--keep_last",
        "1",
    ]
    result = train(out, clicks, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary, metrics = results(out)
    val = [m for m in metrics if m["kind"] == "val"]
    assert summary["stopped_early"] and summary["steps"] < 20 * 80 and summary["steps"] % 80 == 0
    assert [m["step"] for m in val] == list(range(80, summary["steps"] + 1, 80))  # after every epoch
    best = max(val, key=lambda m: m["auroc"])
    assert (summary["best_step"], summary["best_val_auroc"]) == (best["step"], best["auroc"])
    assert summary["steps"] == best["step"] + 2 * 80  # two epochs without improvement
    assert "stopping early after step" in result.stderr
    # the best validation's checkpoint is kept beside the newest (--keep_last 1), marked, and tested
    step_dirs = sorted(name for name in os.listdir(checkpoints) if name.startswith("step_"))
    assert step_dirs == [f"step_{best['step']:08d}", f"step_{summary['steps']:08d}"]
    assert json.loads((checkpoints / "BEST").read_text())["step"] == best["step"]
    manifest = json.loads((checkpoints / step_dirs[-1] / "manifest.json").read_text())
    assert manifest["progress"]["validations"] == {
        "best_step": best["step"],
        "best": {k: v for k, v in best.items() if k not in ("kind", "step")},
        "since_best": 2,
        "stopped_early": True,
    }
    assert summary["test_step"] == best["step"]
    assert f"test (the best validation's model, after step {best['step']})" in result.stderr

    before = (out / "summary.json").read_bytes(), sorted(os.listdir(checkpoints))
    again = train(out, clicks, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to do" in again.stderr and "stopped early" in again.stderr
    assert "read other data" not in again.stderr
    assert ((out / "summary.json").read_bytes(), sorted(os.listdir(checkpoints))) == before
    # Other data in the same --checkpoint_dir: still nothing to do, but said, with the fix.
    elsewhere = train(tmp_path / "elsewhere", clicks + "/day_[0-3].parquet", *args, "--batch_size", "64")
    assert elsewhere.returncode == 0 and "nothing left to do" in elsewhere.stderr, elsewhere.stderr[-3000:]
    assert (
        f"was written by a run that read other data: --data_path {clicks} (now {clicks}/day_[0-3].parquet); "
        "--batch_size 128 (now 64); this run goes on from its step"
    ) in elsewhere.stderr
    assert "give a new --checkpoint_dir" in elsewhere.stderr


@pytest.fixture(scope="module")
def checkpointed(clicks, tmp_path_factory):
    """A run of one epoch (80 steps) on ``clicks``, validated and checkpointed after steps 40 and 80:
    its folder (``out``) and its checkpoints (``ckpt``)."""
    root = tmp_path_factory.mktemp("checkpointed")
    trained = train(root / "train", clicks, "--val_every_steps", "40", "--checkpoint_dir", str(root / "ckpt"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root / "train", root / "ckpt"


def test_a_checkpoint_is_evaluated_without_training_and_bad_requests_are_one_line(clicks, checkpointed, tmp_path):
    out, checkpoints = checkpointed
    _, metrics = results(out)
    best = max((m for m in metrics if m["kind"] == "val"), key=lambda m: m["auroc"])
    before = sorted(os.listdir(checkpoints))

    evaluated = train(tmp_path / "eval", clicks, "--evaluate_checkpoint", "best", "--checkpoint_dir", str(checkpoints))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["evaluated_step"] == best["step"] and "training steps" not in evaluated.stderr
    assert summary["val_auroc"] == best["auroc"]  # the same model on the same rows: the same figure
    assert sorted(os.listdir(checkpoints)) == before  # nothing saved, nothing pruned

    missing = train(tmp_path / "x", clicks, "--evaluate_checkpoint", "7", "--checkpoint_dir", str(checkpoints))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        "--evaluate_checkpoint 7:" in missing.stderr and "committed steps: 40, 80; name one of them" in missing.stderr
    )
    other_model = ["--embedding_dim", "8", "--dense_arch_layer_sizes", "8"]
    differs = train(
        tmp_path / "y", clicks, "--evaluate_checkpoint", "latest", "--checkpoint_dir", str(checkpoints), *other_model
    )
    assert differs.returncode == 2 and "Traceback" not in differs.stderr and "embedding_dim" in differs.stderr


#: The columns of ``clicks`` named one by one, in the reverse of the order their patterns match them.
REVERSED_COLUMNS = [
    "--dense_columns",
    ",".join(f"int_{i}" for i in reversed(range(13))),
    "--sparse_columns",
    ",".join(f"cat_{i}" for i in reversed(range(26))),
]


def test_columns_listed_in_another_order_feed_a_checkpoints_model_by_name(clicks, checkpointed, tmp_path):
    out, checkpoints = checkpointed
    summary, metrics = results(out)
    best = max((m for m in metrics if m["kind"] == "val"), key=lambda m: m["auroc"])
    evaluated = train(
        tmp_path / "eval",
        clicks,
        "--evaluate_checkpoint",
        "best",
        "--checkpoint_dir",
        str(checkpoints),
        *REVERSED_COLUMNS,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    evaluation = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["test_step"] == best["step"]  # the run tested the best validation's model
    assert (evaluation["val_auroc"], evaluation["test_auroc"]) == (best["auroc"], summary["test_auroc"])

    # Resumed from step 40 with the columns so listed, the run trains and tests as it did uninterrupted.
    resumed = tmp_path / "ckpt"
    shutil.copytree(checkpoints, resumed)
    shutil.rmtree(max(resumed.glob("step_*")))  # step 80's: the run resumes from step 40's
    again = train(
        tmp_path / "resumed", clicks, "--val_every_steps", "40", "--checkpoint_dir", str(resumed), *REVERSED_COLUMNS
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_summary, _ = results(tmp_path / "resumed")
    assert (resumed_summary["val_auroc"], resumed_summary["test_auroc"]) == (
        summary["val_auroc"],
        summary["test_auroc"],
    )
