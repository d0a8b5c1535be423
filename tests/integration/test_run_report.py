"""What a finished run writes into its folder (apps/core/training/report.py): summary.json and
metrics.jsonl are JSON that any reader takes (a loss never measured or a metric undefined is
null, not NaN), an early-stopped run logs its last, partial window's loss and draws it, and a
run whose curves cannot be written (a full disk) still succeeds, warning in one line."""

import json
import logging
import math
import os
import sys

import pytest

from apps.core.training.report import CURVES_FILE, METRICS_FILE, Reporter
from tests.conftest import assert_ok, run, tiny

# Tier (tests/conftest.py): real processes; the reporter's own logic is marked unit.
TIER = "integration"


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity refused (Python's json accepts them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.unit
def test_a_value_that_is_no_number_is_written_as_null(tmp_path):
    reporter = Reporter(str(tmp_path), enabled=True)
    reporter.record("val", 10, {"auroc": math.nan, "log_loss": 0.5})
    reporter.write_summary({"final_train_loss": math.nan, "val_auroc": math.inf, "losses": [1.0, -math.inf]})
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary == {"final_train_loss": None, "val_auroc": None, "losses": [1.0, None]}
    assert strict_json((tmp_path / METRICS_FILE).read_text()) == {
        "kind": "val",
        "step": 10,
        "auroc": None,
        "log_loss": 0.5,
    }
    assert reporter.draw_curves((("auroc", "AUROC"),)) == str(tmp_path / CURVES_FILE)  # null points left out


@pytest.mark.unit
def test_curves_on_a_full_disk_are_one_warning_and_the_run_goes_on(tmp_path, caplog):
    """curves.png links to /dev/full, where every write fails with ENOSPC as on a full disk."""
    reporter = Reporter(str(tmp_path), enabled=True)
    reporter.record("train", 5, {"loss": 0.7, "samples_per_sec": 100.0})
    os.symlink("/dev/full", tmp_path / CURVES_FILE)
    with caplog.at_level(logging.INFO, logger="apps.core.training.report"):
        assert reporter.draw_curves((("auroc", "AUROC"),)) is None
        reporter.log_results()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"could not draw {tmp_path / CURVES_FILE} (No space left on device): the run's figures are in summary.json"
    ]
    assert not any(r.getMessage().startswith("curves:") for r in caplog.records)  # no line for a file not drawn


def test_an_early_stopped_run_logs_its_last_partial_window_and_writes_json(tmp_path):
    """Validations every 10 steps, logs every 100: early stopping at step 20 ended the run between
    log steps, with no training loss logged, NaN in summary.json and an empty loss panel (and,
    without --checkpoint_dir, it crashed: it saved the early stop's checkpoint with no folder)."""
    out = tmp_path / "run"
    args = tiny(steps=200, log_every=100, val_batches=2)
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *args,
            "--val_every_steps",
            "10",
            "--early_stopping_patience",
            "1",
            "--early_stopping_min_delta",
            "1",
            "--output_dir",
            str(out),
        ]
    )
    assert_ok(result)
    summary = strict_json((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] == 20
    assert math.isfinite(summary["final_train_loss"])
    train = [m for m in map(strict_json, (out / METRICS_FILE).read_text().splitlines()) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [20] and math.isfinite(train[0]["loss"])
    assert "step 20/200  loss" in result.stderr
    assert (out / CURVES_FILE).exists()
