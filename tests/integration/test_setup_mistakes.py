"""Ordinary setup mistakes, each made as a user makes it (``torchx run`` in a subprocess, with PATH
and the environment arranged to reproduce it): every one is a single line naming what is missing
and the fix, before anything is written or submitted, never a traceback.
"""

import os
import re
import subprocess

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError

from apps.core.common.errors import ConfigError
from apps.core.urls import reaching
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
    """Whether the command failed with ``message`` ending a line (a log line's prefix aside), and
    without a traceback."""
    out = result.stdout + result.stderr
    ends = any(line.rstrip().endswith(message) for line in out.splitlines())
    return result.returncode != 0 and ends and "Traceback" not in out


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


def test_a_slurm_dry_run_needs_no_sbatch(tmp_path):
    # A dry run needs no Slurm: it prints the script.
    dry = torchx("run", "--dryrun", "-s", "slurm", "components.dlrm:train", cwd=str(tmp_path), PATH=BIN)
    assert dry.returncode == 0 and "#SBATCH" in dry.stdout, dry.stderr[-3000:]


# ── Docker and Kubernetes ───────────────────────────────────────────────────────────────────


def no_docker(tmp_path) -> dict[str, str]:
    """The environment of a machine without a Docker engine (and without a cluster)."""
    return {"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock", "KUBECONFIG": str(tmp_path / "no-kubeconfig")}


@pytest.mark.parametrize(
    "scheduler, cfg, request_text",
    [("kubernetes", "queue=default", "kind: Job"), ("aws_batch", "queue=dlrm", '"jobQueue": "dlrm"')],
)
def test_a_dry_run_needs_no_docker(tmp_path, scheduler, cfg, request_text):
    # The default workspace (the folder torchx runs in) would be built into an image.
    args = ["run", "--dryrun", "-s", scheduler, "-cfg", cfg, "components.dlrm:train"]
    result = torchx(*args, cwd=str(tmp_path), **no_docker(tmp_path))
    assert result.returncode == 0 and request_text in result.stdout, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (docker,) = [line for line in result.stderr.splitlines() if "Docker does not answer here" in line]
    assert f"the request shows --image torchrec-dlrm:latest without the workspace {tmp_path} built" in docker
    if scheduler == "kubernetes":  # nor a cluster, whose API server would check the request
        (cluster,) = [line for line in result.stderr.splitlines() if "finds no Kubernetes cluster" in line]
        assert "the API server does not check this request (validate_spec): -s kubernetes finds no" in cluster


@pytest.mark.parametrize("scheduler, cfg", [("kubernetes", "queue=default"), ("aws_batch", "queue=dlrm")])
def test_submitting_a_workspace_without_docker(tmp_path, scheduler, cfg):
    result = torchx(
        "run", "-s", scheduler, "-cfg", cfg, "components.dlrm:train", cwd=str(tmp_path), **no_docker(tmp_path)
    )
    assert says_in_one_line(
        result,
        f"-s {scheduler} builds the workspace {tmp_path} into an image with Docker, which does not answer here "
        f"(Error while fetching server API version: ('Connection aborted.', FileNotFoundError(2, 'No such file or "
        f'directory\'))): start Docker, or pass --workspace "" to run --image as it is',
    ), result.stderr[-3000:]


@pytest.mark.parametrize("scheduler, cfg", [("kubeflow", "namespace=default"), ("kubernetes", "queue=default")])
@pytest.mark.parametrize("kubeconfig", ["missing", "not-yaml"])
def test_submitting_without_a_kubeconfig(tmp_path, scheduler, cfg, kubeconfig):
    path = tmp_path / kubeconfig
    if kubeconfig == "not-yaml":
        path.write_text("users: [{token: s3cr3t-token\n")
    reason = {
        "missing": "Invalid kube-config file. No configuration found.",
        "not-yaml": "while parsing a flow mapping",
    }[kubeconfig]
    args = ["run", "-s", scheduler, "-cfg", cfg, "--workspace", "", "components.dlrm:train"]
    result = torchx(*args, cwd=str(tmp_path), KUBECONFIG=str(path), HOME=str(tmp_path))
    assert says_in_one_line(
        result,
        f"-s {scheduler} finds no Kubernetes cluster to talk to in KUBECONFIG={path} ({reason}): set KUBECONFIG to "
        "kubectl's kubeconfig file, or write ~/.kube/config; a dry run (--dryrun) needs no cluster",
    ), result.stderr[-3000:]
    assert "s3cr3t" not in result.stdout + result.stderr


# ── AWS Batch ───────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET},
            "-s aws_batch has no AWS region to submit to: set AWS_DEFAULT_REGION (e.g. AWS_DEFAULT_REGION=us-west-2), "
            "or run `aws configure`",
        ),
        (
            {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET},
            "-s aws_batch has no AWS region to submit to: boto3 does not read AWS_REGION=eu-west-1: set "
            "AWS_DEFAULT_REGION=eu-west-1",
        ),
        (
            {"AWS_DEFAULT_REGION": "us-west-2"},
            "-s aws_batch found no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE), run `aws configure`, or run where an IAM role gives them",
        ),
        (
            {"AWS_DEFAULT_REGION": "us-west-2", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"},
            "-s aws_batch cannot read the AWS configuration (Partial credentials found in env, missing: "
            "AWS_SECRET_ACCESS_KEY): fix AWS_PROFILE, the AWS_* variables or ~/.aws/config, or run `aws configure`",
        ),
        (
            {
                "AWS_DEFAULT_REGION": "us-west-2",
                "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
                "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            },
            "-s aws_batch cannot reach AWS Batch: the endpoint http://127.0.0.1:9 refuses the connection: check "
            "AWS_ENDPOINT_URL=http://127.0.0.1:9 and that the server is up",
        ),
    ],
    ids=["no-region", "aws-region-only", "no-credentials", "half-a-key", "refused-endpoint"],
)
def test_submitting_to_aws_batch_without_its_setup(tmp_path, env, message):
    cmd = [os.path.join(BIN, "torchx"), "run", "-s", "aws_batch", "-cfg", "queue=dlrm", "--workspace", ""]
    result = run_without_aws([*cmd, "components.dlrm:train"], str(tmp_path), **env)
    assert says_in_one_line(result, message), result.stderr[-3000:]
    assert SECRET not in result.stdout + result.stderr


# ── Reading a submitted job ─────────────────────────────────────────────────────────────────

SLURM_FIX = "run torchx on a Slurm login node, or install Slurm's client commands (Debian: slurm-client)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["status", "foo"], "torchx status: foo is not of the form: <scheduler_backend>://<session_name>/<app_id>"),
        (
            ["cancel", "nope://torchx/x"],
            "torchx cancel: no scheduler 'nope' here: an app handle starts with one of aws_batch, kubeflow, "
            "kubernetes, local_cwd, local_docker, slurm",
        ),
        (
            ["describe", "kubeflow://torchx/bad"],
            "torchx describe: `bad` is not a kubeflow app id: expected NAMESPACE:KIND:NAME",
        ),
        (
            ["status", "slurm://torchx/123"],
            f"torchx status: squeue is not on PATH (-s slurm reads jobs' states with it): {SLURM_FIX}",
        ),
        (["list", "-s", "slurm"], f"torchx list: squeue is not on PATH (-s slurm lists jobs with it): {SLURM_FIX}"),
        (
            ["log", "local_cwd://torchx/dlrm-x1/train/0"],
            "torchx log: local_cwd://torchx/dlrm-x1 is not running in this process: a local app is known only to "
            "its `torchx run`; each run's folder (outputs/<app id>/ by default",
        ),
        (["list", "-s", "local_cwd"], "torchx list: -s local_cwd keeps no list of its apps"),
    ],
    ids=[
        "not-a-handle",
        "no-such-scheduler",
        "not-a-kubeflow-id",
        "slurm-status",
        "slurm-list",
        "local-log",
        "local-list",
    ],
)
def test_reading_a_job_with_a_wrong_handle_or_on_a_machine_without_the_scheduler(tmp_path, args, message):
    # PATH: this environment's torchx and Python only, as on a machine without Slurm's commands.
    result = subprocess.run(
        [os.path.join(BIN, "torchx"), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=process_env(PATH=BIN),
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(message), result.stderr[-3000:]


def test_aws_batch_status_without_a_region_is_one_line(tmp_path):
    result = run_without_aws([os.path.join(BIN, "torchx"), "status", "aws_batch://torchx/dlrm:job-1"], str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "torchx status: -s aws_batch has no AWS region to submit to: set AWS_DEFAULT_REGION (e.g. "
        "AWS_DEFAULT_REGION=us-west-2), or run `aws configure`"
    )


# ── The project's Python ────────────────────────────────────────────────────────────────────


def test_trainers_run_with_torchxs_python_where_the_environment_is_not_activated(tmp_path):
    """``.venv/bin/torchx`` run with another ``python`` first on PATH (the environment not activated):
    the trainers used to run with that one (``ModuleNotFoundError: No module named 'torch'``)."""
    system = tmp_path / "system-bin"
    system.mkdir()
    python = system / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(0o755)
    cmd = [*LOCAL_TRAIN_1X2, *tiny(steps=4)]
    result = subprocess.run(
        [*cmd, "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env=process_env(PATH=f"{system}{os.pathsep}/usr/bin{os.pathsep}/bin"),
    )
    assert result.returncode == 0 and (tmp_path / "out" / "summary.json").exists(), result.stderr[-3000:]
    assert "ModuleNotFoundError" not in result.stdout + result.stderr


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
    # The launcher's line quotes the rank that stopped the job, whichever rank met the error first.
    assert re.search(f"apps.dlrm.train failed on .*: rank [01] exited with 2: {re.escape(message)}", out), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert SECRET not in out


#: Each cluster scheduler, with the options its dry run needs.
CLUSTERS = [
    ("slurm", []),
    ("kubernetes", ["-cfg", "queue=default"]),
    ("kubeflow", []),
    ("aws_batch", ["-cfg", "queue=q"]),
]


def gpu_dry_run(scheduler: str, cfg: list[str]) -> list[str]:
    """``torchx run --dryrun`` of 2 nodes of 8 GPUs on ``scheduler``, the nodes' size left to the caller."""
    return ["run", "--dryrun", "-s", scheduler, *cfg, "--workspace", "", "components.dlrm:train", "-j", "2x8"]


@pytest.mark.parametrize("scheduler, cfg", CLUSTERS)
def test_gpu_nodes_with_the_laptop_defaults_are_refused_on_clusters(tmp_path, scheduler, cfg):
    # The README's old example: 8 GPUs per node with 2 CPUs and 8 GB.
    result = torchx(*gpu_dry_run(scheduler, cfg), "--gpu", "8", cwd=str(tmp_path))
    assert says_in_one_line(
        result,
        f"-s {scheduler}: --gpu 8 asks each node for 8 GPUs with --cpu 2 and --memMB 8192, defaults sized "
        "for -s local_cwd: give -h with the nodes' instance type (e.g. -h aws_p4d.24xlarge), or the "
        "nodes' --cpu and --memMB (e.g. --cpu 64 --memMB 500000)",
    ), result.stderr[-3000:]
    # Sized nodes pass.
    sized = torchx(*gpu_dry_run(scheduler, cfg), "--gpu", "8", "--cpu", "64", "--memMB", "500000", cwd=str(tmp_path))
    assert sized.returncode == 0, sized.stderr[-3000:]


def test_which_node_requests_count_as_the_laptop_defaults(tmp_path):
    """The component marks the request (the same for every cluster scheduler, each of which refuses
    a marked one above): a default left is still named; an instance type sizes the nodes; local_cwd,
    which requests nothing, takes --gpu alone."""
    dry = gpu_dry_run(*CLUSTERS[0])
    half = torchx(*dry, "--gpu", "8", "--cpu", "64", cwd=str(tmp_path))
    assert half.returncode != 0 and "with --memMB 8192, defaults sized" in half.stderr, half.stderr[-3000:]
    named = torchx(*dry, "-h", "aws_p4d.24xlarge", cwd=str(tmp_path))
    assert named.returncode == 0, named.stderr[-3000:]
    local = torchx("run", "--dryrun", "components.dlrm:train", "-j", "1x2", "--gpu", "2", cwd=str(tmp_path))
    assert local.returncode == 0, local.stderr[-3000:]
