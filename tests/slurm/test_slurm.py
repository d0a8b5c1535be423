"""The DLRM component on real Slurm clusters, as a user drives it: `torchx run -s slurm`, then
`torchx status`, `torchx log`, `torchx list` and `torchx cancel`.

The clusters are scripts/slurm_cluster.sh's Slurm 24.11 and Slurm 22.05 (the oldest release our
`-s slurm`, schedulers/slurm.py, supports), each with slurmdbd and two nodes, n1 and n2, each a
host of its own on a private network (a network namespace). The first start on a machine builds a
cluster's root (75-120 s). A cluster started here is stopped again at the end; one that was
already running is left running.
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

# Tier (tests/conftest.py): real Slurm clusters (root).
TIER = "slurm"

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
    version = subprocess.run(["sinfo", "--version"], env={**env, "PATH": path}, capture_output=True, text=True)
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
        result = torchx(slurm_path, tmp_path, "run", "-s", "slurm", "components.dlrm:train", *component_args)
        assert_ok(result)
        handle = result.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"slurm://[^/]+/\d+", handle), result.stdout
        return handle

    yield submit
    # Found by their directory: a job whose `torchx run` failed after sbatch has no handle.
    if left := queued(slurm_path, tmp_path):
        slurm(slurm_path, tmp_path, "scancel", *left)


def slurm(path: str, cwd, *cmd: str) -> str:
    """The output of the cluster's command ``cmd`` (squeue, sacct, ...), run from ``cwd``."""
    return subprocess.run(
        cmd, cwd=cwd, env={**os.environ, "PATH": path}, capture_output=True, text=True, check=True
    ).stdout


def queued(path: str, cwd) -> set[str]:
    """The ids of the apps submitted from ``cwd`` that are still in the queue."""
    queue = slurm(path, cwd, "squeue", "--noheader", "--format=%i %Z")
    rows = (line.partition(" ") for line in queue.splitlines())
    return {job.split("+")[0] for job, _, job_cwd in rows if job_cwd == str(cwd)}  # 12+1: het job 12


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
    # Submitted from a directory of its own: the job runs there and writes its logs to its run's folder.
    handle = submit("-j", "1x2", *TINY, "--output_dir", str(out))
    states = states_until(slurm_path, tmp_path, handle, TERMINAL_STATES)
    logs = torchx(slurm_path, tmp_path, "log", handle)
    assert states[-1] == "SUCCEEDED", f"states {states}\n{logs.stdout[-4000:]}"
    assert "RUNNING" in states  # status works while the job runs, not only once it is over

    assert_ok(logs)
    assert "train/0" in logs.stdout and "validation: accuracy" in logs.stdout, logs.stdout[-4000:]
    assert f"summary: {out}/summary.json" in logs.stdout
    app_id = handle.rsplit("/", 1)[-1]
    assert not list(tmp_path.glob("slurm-*"))  # every log in the run's folder, the script's own too
    assert {f"slurm-{app_id}.out", f"slurm-{app_id}-train-0.out", f"slurm-{app_id}-train-0.err"} <= set(os.listdir(out))

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
    long_job = tiny(steps=1_000_000)
    # One part on each node, each holding all its CPUs (cpu=2), so the second job waits in the
    # queue behind the first.
    first = submit("-j", "2x1", *long_job, "--output_dir", str(tmp_path / "first"))
    assert states_until(slurm_path, tmp_path, first, {"RUNNING"} | TERMINAL_STATES)[-1] == "RUNNING"
    second = submit("-j", "1x2", *long_job, "--output_dir", str(tmp_path / "second"))
    assert state_of(slurm_path, tmp_path, second) == "PENDING"
    assert state_of(slurm_path, tmp_path, first) == "RUNNING"

    wait_until(lambda: processes_with(str(tmp_path / "first")), "the first job's trainers to start")
    cancel(slurm_path, tmp_path, second)
    cancel(slurm_path, tmp_path, first)
    wait_until(lambda: not processes_with(str(tmp_path / "first")), "the trainers to exit after the cancel")


def test_a_multi_node_job_is_one_app_while_it_waits_for_nodes(slurm_path, submit, tmp_path, monkeypatch):
    # Each node of a multi-node job is a component of one heterogeneous Slurm job, whose
    # components never share a node, and the cluster's two nodes can never hold three: the job
    # waits in the queue.
    handle = submit("-j", "3x1", "--cpu", "1", "--memMB", "1000", *TINY)
    app_id = int(handle.rsplit("/", 1)[-1])
    out = status(slurm_path, tmp_path, handle)
    replicas = r"\s*".join(rf"train\[{i}\]:PENDING\n" for i in range(3))
    assert re.search(rf"State: PENDING\n(.*\n)*.*{replicas}", out), out
    # `torchx list` reads squeue where Slurm keeps no accounting: the app once, by its id.
    monkeypatch.setenv("PATH", slurm_path)
    monkeypatch.chdir(tmp_path)
    listed = {int(app.app_id): app.state.name for app in SlurmScheduler("test")._list_squeue()}
    assert listed.get(app_id) == "PENDING" and not {app_id + 1, app_id + 2} & set(listed), listed
    cancel(slurm_path, tmp_path, handle)


# final_train_loss of the one-node jobs, by -j. The computation is the app's, whatever the Slurm
# release, so each runs once, on the first cluster that needs it: the tests stay short.
ONE_NODE_LOSS: dict[str, float] = {}


@pytest.mark.parametrize("nproc", [1, 2], ids=lambda n: f"2x{n}")
def test_a_job_on_both_nodes_trains_exactly_as_the_same_ranks_on_one(slurm_path, submit, tmp_path, nproc):
    # One part on each node, each node's trainers on a host of their own: they find the first
    # node by its name, and meet over the network (rendezvous, gloo). The data depends on the
    # global rank only, so on CPU the loss is the one-node job's.
    two_nodes, one_node = f"2x{nproc}", f"1x{2 * nproc}"
    sizes = [two_nodes] if one_node in ONE_NODE_LOSS else [two_nodes, one_node]
    # Each job holds all the CPUs of its nodes (cpu=2): they run one after the other. The nodes
    # share this machine's cores, and torchrun sets one thread per trainer only where a node runs
    # several: -j 2x1 would run 2 trainers of 2 threads each on 2 cores, several times slower.
    one_thread = ["--env", "OMP_NUM_THREADS=1"]
    handles = {j: submit("-j", j, *TINY, *one_thread, "--output_dir", str(tmp_path / j)) for j in sizes}
    wait_until(lambda: not queued(slurm_path, tmp_path), "the jobs to end", timeout=240)
    for j, handle in handles.items():
        state = states_until(slurm_path, tmp_path, handle, TERMINAL_STATES, timeout=30)[-1]
        logs = torchx(slurm_path, tmp_path, "log", handle).stdout if state != "SUCCEEDED" else ""
        assert state == "SUCCEEDED", f"-j {j}: {state}\n{logs[-4000:]}"

    app_id = handles[two_nodes].rsplit("/", 1)[-1]
    nodes = slurm(
        slurm_path,
        tmp_path,
        "sacct",
        "--noheader",
        "--parsable2",
        "--allocations",
        f"--jobs={app_id}",
        "--format=NodeList",
    )
    assert sorted(nodes.split()) == ["n1", "n2"], nodes
    # Each part's trainers saw their own host: its hostname and its address (apps.dlrm.torchrun).
    logs = "".join(path.read_text() for path in (tmp_path / two_nodes).glob(f"slurm-{app_id}-*.err"))
    hosts = dict(re.findall(r"host (n\d): rendezvous at n1:\d+.*; this host is ([\d.]+) on ", logs))
    assert sorted(hosts) == ["n1", "n2"] and len(set(hosts.values())) == 2, logs[-4000:]

    losses = {j: json.loads((tmp_path / j / "summary.json").read_text())["final_train_loss"] for j in sizes}
    if one_node in losses:
        ONE_NODE_LOSS[one_node] = losses[one_node]
    assert losses[two_nodes] == pytest.approx(ONE_NODE_LOSS[one_node], abs=1e-6), (losses, ONE_NODE_LOSS)


def test_submitting_from_a_directory_the_cluster_cannot_see_is_refused_clearly(slurm_path):
    # /var/tmp is not shared with the cluster's root, so the job could not run there.
    with tempfile.TemporaryDirectory(dir="/var/tmp") as unshared:
        result = torchx(slurm_path, unshared, "run", "-s", "slurm", "components.dlrm:train", *TINY)
    assert result.returncode != 0
    message = f"sbatch: {unshared} is not shared with the Slurm cluster"
    assert message in result.stderr, result.stderr[-3000:]
    assert "SLURM_CLUSTER_MOUNTS" in result.stderr
