"""The DLRM component on real Slurm clusters, as a user drives it: `torchx run -s slurm`, then
`torchx status`, `torchx log`, `torchx list` and `torchx cancel`.

The clusters are scripts/slurm_cluster.sh's one-node Slurm 24.11 and Slurm 22.05 (the oldest
release our `-s slurm`, schedulers/slurm.py, supports), each with slurmdbd. The first start on a
machine builds a cluster's root (75-120 s). A cluster started here is stopped again at the end;
one that was already running is left running.
"""

import json
import os
import re
import subprocess
import tempfile
import time

import pytest
from torchx.schedulers import get_scheduler_factories

from schedulers.slurm import SlurmScheduler
from tests.conftest import BIN, REPO, TINY, assert_ok, run, tiny

CLUSTER = os.path.join(REPO, "scripts", "slurm_cluster.sh")
TERMINAL_STATES = {"SUCCEEDED", "FAILED", "CANCELLED"}
# Debian release of the cluster's root -> the Slurm release it runs
SLURM_OF_SUITE = {"trixie": "24.11", "bookworm": "22.05"}


@pytest.fixture(scope="module", params=list(SLURM_OF_SUITE), ids=lambda s: f"slurm-{SLURM_OF_SUITE[s]}")
def slurm_path(request):
    """PATH with the cluster's sbatch, squeue, ... first, then this venv's torchx and torchrun."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm cluster needs root (scripts/slurm_cluster.sh uses chroot and mount)")
    env = {**os.environ, "SLURM_CLUSTER_SUITE": request.param}

    def cluster(command: str, timeout: int = 120) -> subprocess.CompletedProcess:
        return subprocess.run([CLUSTER, command], env=env, capture_output=True, text=True, timeout=timeout)

    was_running = cluster("status").returncode == 0
    started = cluster("start", timeout=900)
    assert started.returncode == 0, f"scripts/slurm_cluster.sh start failed:\n{started.stderr}"
    path = os.pathsep.join([cluster("bin").stdout.strip(), BIN, os.environ["PATH"]])
    version = subprocess.run(["sinfo", "--version"], env={**env, "PATH": path}, capture_output=True,
                             text=True)
    assert version.stdout.split()[1].startswith(SLURM_OF_SUITE[request.param] + "."), version
    yield path
    if not was_running:
        stopped = cluster("stop")
        assert stopped.returncode == 0, stopped.stderr


def torchx(path: str, cwd, *args: str) -> subprocess.CompletedProcess:
    return run([os.path.join(BIN, "torchx"), *args], cwd=str(cwd), timeout=120, PATH=path)


@pytest.fixture
def submit(slurm_path, tmp_path):
    """`torchx run -s slurm components.dlrm:train ARGS` from tmp_path; returns the app handle it
    prints. The jobs that the test leaves in the queue are cancelled."""

    def submit(*component_args: str) -> str:
        result = torchx(slurm_path, tmp_path, "run", "-s", "slurm", "components.dlrm:train",
                        *component_args)
        assert_ok(result)
        handle = result.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"slurm://[^/]+/\d+", handle), result.stdout
        return handle

    yield submit
    # Found by their directory: a job whose `torchx run` failed after sbatch has no handle.
    slurm = {"cwd": tmp_path, "env": {**os.environ, "PATH": slurm_path}, "capture_output": True,
             "text": True}
    queue = subprocess.run(["squeue", "--noheader", "--format=%i %Z"], check=True, **slurm).stdout
    rows = (line.partition(" ") for line in queue.splitlines())
    left = {job.split("+")[0] for job, _, cwd in rows if cwd == str(tmp_path)}  # 12+1: het job 12
    if left:
        subprocess.run(["scancel", *left], check=True, **slurm)


def status(path: str, cwd, handle: str) -> str:
    result = torchx(path, cwd, "status", handle)
    assert_ok(result)
    return result.stdout


def state_of(path: str, cwd, handle: str) -> str:
    match = re.search(r"State: (\w+)", out := status(path, cwd, handle))
    assert match, out
    return match.group(1)


def states_until(path: str, cwd, handle: str, stop: set[str], timeout: float = 180) -> list[str]:
    """The states `torchx status` reports, polled every second until one in ``stop``."""
    states = []
    deadline = time.monotonic() + timeout
    while not states or states[-1] not in stop:
        assert time.monotonic() < deadline, f"{handle} still {states[-1]} after {timeout} s"
        if states:
            time.sleep(1)
        states.append(state_of(path, cwd, handle))
    return states


def cancel(path: str, cwd, handle: str) -> None:
    assert_ok(torchx(path, cwd, "cancel", handle))
    assert states_until(path, cwd, handle, TERMINAL_STATES, timeout=60)[-1] == "CANCELLED"


def wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.5)


def processes_with(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_slurm_is_our_scheduler():
    assert isinstance(get_scheduler_factories()["slurm"](session_name="test"), SlurmScheduler)


def test_dlrm_job_on_slurm_succeeds_and_reports_status_and_logs(slurm_path, submit, tmp_path):
    out = tmp_path / "outputs"
    # Submitted from a directory of its own: the job runs there and writes its logs there.
    handle = submit("-j", "1x2", *TINY, "--output_dir", str(out))
    states = states_until(slurm_path, tmp_path, handle, TERMINAL_STATES)
    logs = torchx(slurm_path, tmp_path, "log", handle)
    assert states[-1] == "SUCCEEDED", f"states {states}\n{logs.stdout[-4000:]}"
    assert "RUNNING" in states  # status works while the job runs, not only once it is over

    assert_ok(logs)
    assert "train/0" in logs.stdout and "validation: accuracy" in logs.stdout, logs.stdout[-4000:]
    assert f"wrote {out}/summary.json" in logs.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == int(TINY[TINY.index("--steps") + 1])
    assert summary["val_auroc"] > 0.6  # it learned (0.5 is chance)
    ranks = {line.rsplit(" ", 1)[-1] for line in summary["sharding_plan"]}
    assert {"0", "1"} <= set(",".join(ranks).split(","))  # tables on both ranks

    # Finished jobs come from Slurm's accounting (sacct, slurmdbd).
    listed = torchx(slurm_path, tmp_path, "list", "-s", "slurm")
    assert_ok(listed)
    assert re.search(rf"^{re.escape(handle)}\s+.*SUCCEEDED\s*$", listed.stdout, re.M), listed.stdout


def test_status_tells_queued_jobs_apart_and_cancel_stops_them(slurm_path, submit, tmp_path):
    long_job = ["-j", "1x2", *tiny(steps=1_000_000)]
    first = submit(*long_job, "--output_dir", str(tmp_path / "first"))
    assert states_until(slurm_path, tmp_path, first, {"RUNNING"} | TERMINAL_STATES)[-1] == "RUNNING"
    # The first job holds both CPUs of the node, so the second waits in the queue behind it.
    second = submit(*long_job, "--output_dir", str(tmp_path / "second"))
    assert state_of(slurm_path, tmp_path, second) == "PENDING"
    assert state_of(slurm_path, tmp_path, first) == "RUNNING"

    wait_until(lambda: processes_with(str(tmp_path / "first")), "the first job's trainers to start")
    cancel(slurm_path, tmp_path, second)
    cancel(slurm_path, tmp_path, first)
    wait_until(lambda: not processes_with(str(tmp_path / "first")), "the trainers to exit after the cancel")


def test_a_multi_node_job_is_one_app_while_it_waits_for_nodes(slurm_path, submit, tmp_path, monkeypatch):
    # Each node of a multi-node job is a component of one heterogeneous Slurm job, and the
    # cluster's one node can never hold both: the job waits in the queue.
    handle = submit("-j", "2x1", "--cpu", "1", "--memMB", "1000", *TINY)
    app_id = int(handle.rsplit("/", 1)[-1])
    out = status(slurm_path, tmp_path, handle)
    assert re.search(r"State: PENDING\n(.*\n)*.*train\[0\]:PENDING\n\s*train\[1\]:PENDING\n", out), out
    # `torchx list` reads squeue where Slurm keeps no accounting: the app once, by its id.
    monkeypatch.setenv("PATH", slurm_path)
    monkeypatch.chdir(tmp_path)
    queued = {int(app.app_id): app.state.name for app in SlurmScheduler("test")._list_squeue()}
    assert queued.get(app_id) == "PENDING" and app_id + 1 not in queued, queued
    cancel(slurm_path, tmp_path, handle)


def test_submitting_from_a_directory_the_cluster_cannot_see_is_refused_clearly(slurm_path):
    # /var/tmp is not shared with the cluster's root, so the job could not run there.
    with tempfile.TemporaryDirectory(dir="/var/tmp") as unshared:
        result = torchx(slurm_path, unshared, "run", "-s", "slurm", "components.dlrm:train", *TINY)
    assert result.returncode != 0
    message = f"sbatch: {unshared} is not shared with the Slurm cluster"
    assert message in result.stderr, result.stderr[-3000:]
    assert "SLURM_CLUSTER_MOUNTS" in result.stderr
