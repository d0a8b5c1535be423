"""Ordinary setup mistakes, each made as a user makes it (``torchx run`` in a subprocess, with PATH
and the environment arranged to reproduce it): every one is a single line naming what is missing
and the fix, before anything is written or submitted, never a traceback.
"""

import os
import subprocess

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError

from apps.dlrm.common.errors import ConfigError
from apps.dlrm.urls import reaching
from tests.conftest import BIN, LOCAL_TRAIN_1X2, process_env, run, tiny

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

#: The AWS configuration boto3 reads from the environment; tests start from none of it.
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
)
#: A secret access key in AWS's documentation's shape, which no output may show.
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def run_without_aws(cmd: list[str], cwd: str, **env: str) -> subprocess.CompletedProcess:
    """``cmd`` on a machine with no AWS configuration but ``env`` (and no instance role to fall
    back on), in ``cwd``."""
    full = process_env(
        AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull
    )
    for name in AWS_VARIABLES:
        full.pop(name, None)
    full.update(env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=full)


def torchx(*args: str, cwd: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return run([os.path.join(BIN, "torchx"), *args], timeout=300, cwd=cwd, **env)


def says_in_one_line(result: subprocess.CompletedProcess, message: str) -> bool:
    """Whether the command failed with ``message`` on a line of its own (a log line's prefix
    aside), and without a traceback."""
    out = result.stdout + result.stderr
    lines = [line for line in out.splitlines() if message in line]
    return result.returncode != 0 and len(lines) >= 1 and lines[0].rstrip().endswith(message) and "Traceback" not in out


# ── Slurm ───────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("cfg", ["partition=gpu", "job_dir=job"], ids=["no-job-dir", "job-dir"])
def test_slurm_without_sbatch_on_path(tmp_path, cfg):
    # PATH: this environment's torchx and Python only, as on a machine without Slurm's commands.
    result = torchx("run", "-s", "slurm", "-cfg", cfg, "components.dlrm:train", cwd=str(tmp_path), PATH=BIN)
    assert says_in_one_line(
        result,
        "sbatch is not on PATH (-s slurm submits jobs with it): run torchx on a Slurm login node, or install "
        "Slurm's client commands (Debian: slurm-client)",
    ), result.stderr[-3000:]
    assert os.listdir(tmp_path) == []  # neither the script nor the workspace copied into job_dir
    # A dry run needs no Slurm: it prints the script.
    dry = torchx("run", "--dryrun", "-s", "slurm", "components.dlrm:train", cwd=str(tmp_path), PATH=BIN)
    assert dry.returncode == 0 and "#SBATCH" in dry.stdout, dry.stderr[-3000:]


# ── S3 (checkpoints and data, read by the trainers) ─────────────────────────────────────────


@pytest.mark.unit
@pytest.mark.parametrize(
    "error, message",
    [
        (
            NoCredentialsError(),
            "--data_path s3://***@clicks/train cannot be reached: no AWS credentials were found: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), run `aws configure`, or run where an "
            "IAM role gives them",
        ),
        (
            EndpointConnectionError(endpoint_url="http://minio:9000/clicks?list-type=2"),
            "--data_path s3://***@clicks/train cannot be reached: the endpoint http://minio:9000 refuses the "
            "connection: check AWS_ENDPOINT_URL=http://minio:9000 and that the server is up",
        ),
    ],
)
def test_an_object_store_that_cannot_be_reached_is_one_line_without_the_urls_credentials(monkeypatch, error, message):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    with pytest.raises(ConfigError) as refused, reaching("--data_path", "s3://AKIAKEY:s3cr3t@clicks/train"):
        raise error
    assert str(refused.value) == message


@pytest.mark.unit
def test_other_storage_errors_pass_through_reaching():
    with pytest.raises(FileNotFoundError), reaching("--data_path", "s3://clicks/train"):
        raise FileNotFoundError("clicks/train")


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ["--checkpoint_dir", "s3://dlrm-ckpt/run"],
            {},
            "--checkpoint_dir s3://dlrm-ckpt/run cannot be reached: no AWS credentials were found: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), run `aws configure`, or run where an "
            "IAM role gives them",
        ),
        (
            ["--data", "parquet", "--data_path", "s3://clicks/train/"],
            {
                "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
                "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            },
            "--data_path s3://clicks/train/ cannot be reached: the endpoint http://127.0.0.1:9 refuses the "
            "connection: check AWS_ENDPOINT_URL=http://127.0.0.1:9 and that the server is up",
        ),
    ],
    ids=["no-credentials", "refused-endpoint"],
)
def test_s3_that_cannot_be_reached_stops_the_job_in_one_line(tmp_path, args, env, message):
    cmd = [*LOCAL_TRAIN_1X2, *tiny(), "--output_dir", str(tmp_path / "out"), *args]
    result = run_without_aws(cmd, str(tmp_path), AWS_DEFAULT_REGION="us-west-2", **env)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and out.count(message) == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert SECRET not in out
