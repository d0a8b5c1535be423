"""Criteo end to end, as a user runs it: generated click logs with every bad kind, preprocessed by
`torchx run -s local_cwd components.dlrm:preprocess`, then trained on by two torchrun processes.
And the preprocess component's arguments."""

import json
import os
import shlex

import pytest

from apps.core.options import options_of
from apps.dlrm.data.criteo.config import PreprocessConfig, parse_preprocess_config
from components import dlrm
from components.cpu_launch import CpuLaunch
from components.signature import InvalidComponentArgument
from testing.criteo_files import generate_day, write_day
from tests.conftest import BIN, assert_ok, run, tiny, torchrun

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


def test_preprocess_then_train_two_ranks_on_the_criteo_files(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    days = [generate_day(4000, seed) for seed in range(4)]
    for d, day in enumerate(days):
        write_day(day, raw / f"day_{d}.gz", compress=True)
    data = tmp_path / "criteo_npy"
    result = run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "-s",
            "local_cwd",
            "components.dlrm:preprocess",
            "--input",
            str(raw),
            "--output",
            str(data),
            "--num_embeddings",
            "2000",
        ],
        cwd=str(tmp_path),
        timeout=300,
    )
    assert_ok(result)
    report = json.loads((data / "report.json").read_text())
    assert report["rows_written"] == sum(day.rows_written for day in days)
    assert report["skipped"]["wrong_column_count"] == sum(day.skipped["wrong_column_count"] for day in days)

    # Tables smaller than those the folder was preprocessed for: refused at submission, not by the job.
    result = run(
        [os.path.join(BIN, "torchx"), "run", "--dryrun", "components.dlrm:train", "--data", "criteo"]
        + ["--data_path", str(data), "--num_embeddings", "1000"],
        cwd=str(tmp_path),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{data} was preprocessed for embedding tables of 2000," in result.stderr

    out = tmp_path / "outputs"
    result = torchrun(
        [
            "-m",
            "apps.dlrm.train",
            "--data",
            "criteo",
            "--data_path",
            str(data),
            "--output_dir",
            str(out),
            *tiny(val_batches=0, test_batches=0, epochs=3),
        ],
    )
    assert_ok(result)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert summary["config"]["data"] == "criteo" and summary["auroc_ceiling"] is None
    # Clicks in the generated logs follow categorical feature 0 and integer feature 0: a model
    # fed each sample's own features and label learns them; misaligned rows would give 0.5.
    # (0.71 here; the generator's own click model reaches 0.83.)
    assert summary["val_auroc"] > 0.65, summary
    assert summary["test_auroc"] > 0.65, summary
    held_out = days[-1].rows_written  # --eval_days 1: the last day's halves
    assert f"validation {(held_out + 1) // 2:,}, test {held_out // 2:,}" in result.stderr


def app_command(app) -> list[str]:
    (role,) = app.roles
    return [role.entrypoint, *role.args]


@pytest.mark.unit
def test_preprocess_component_passes_its_arguments_to_the_app():
    app = dlrm.preprocess(
        input=["s3://bucket/criteo/"],
        output="/data/npy",
        table_size_preset="mlperf",
        categorical_ids="vocabulary",
        cpu=32,
        memMB=64_000,
        mounts=["type=bind", "src=/data", "dst=/data"],
    )
    (role,) = app.roles
    cmd = app_command(app)
    assert cmd[:3] == ["python", "-m", "apps.dlrm.preprocess"]
    assert parse_preprocess_config(cmd[3:]) == PreprocessConfig(
        input=["s3://bucket/criteo/"], output="/data/npy", table_size_preset="mlperf", categorical_ids="vocabulary"
    )
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (32, 0, 64_000)
    assert role.num_replicas == 1 and role.env["PYTHONUNBUFFERED"] == "1"
    assert role.mounts[0].dst_path == "/data"


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(output="/o"), "--input is missing"),
        (dict(input=["a"], output="/o", num_embeddings_per_feature=[1, 2]), "has 2 entries"),
        (dict(input=["a"], output="/o", cpu=0), "--cpu 0"),
        (dict(input=["a"], output="/o", j="1x2"), "unknown component arguments: j"),
    ],
)
def test_bad_preprocess_arguments_fail_before_anything_is_submitted(kwargs, fragment):
    with pytest.raises(InvalidComponentArgument, match=fragment):
        dlrm.preprocess(**kwargs)


def test_preprocess_help_is_the_apps_manual(tmp_path):
    result = run([os.path.join(BIN, "torchx"), "run", "components.dlrm:preprocess", "--help"], cwd=str(tmp_path))
    assert_ok(result)
    for name in [field.name for field in options_of(PreprocessConfig)] + list(CpuLaunch.__dataclass_fields__):
        assert f"--{name}" in result.stdout, name
    assert "--rdzv_port" not in result.stdout and "--gpu" not in result.stdout
    assert "report.json" in " ".join(result.stdout.split())
    dry = run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "--dryrun",
            "-s",
            "local_cwd",
            "components.dlrm:preprocess",
            "--input",
            "/in",
            "--output",
            "/out",
        ],
        cwd=str(tmp_path),
    )
    assert_ok(dry)
    assert "apps.dlrm.preprocess" in dry.stdout + dry.stderr and shlex.quote("/in") in dry.stdout + dry.stderr
