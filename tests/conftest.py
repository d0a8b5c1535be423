"""Test tiers, shared fixtures, and helpers for tests that start real processes (torchrun, torchx).

Every test belongs to one tier (docs/development.md: Tests), the closest of: its own ``@pytest.mark.<tier>``,
else its module's ``TIER``. A test with neither is a collection error, so no test falls through
the tiers unseen:

- ``unit``: pure logic in this process, seconds for the whole tier (``make test-fast``);
- ``integration``: real processes and servers on loopback (torchrun, ``torchx run``, moto,
  the GCS emulator, network namespaces);
- ``slurm``: real Slurm clusters in debootstrapped roots (root; the first run builds them);
- ``gpu``: needs CUDA GPUs, skipped with the reason where there are none;
- ``slow``: minutes (a container build, the GPU machine's row), left out of ``make test`` (``make test-slow``).

A module lies in the folder of its ``TIER`` (tests/unit, tests/integration, tests/slurm, tests/slow;
its gpu-marked tests stay in it), so that the folders show what each test needs; one elsewhere is a
collection error too (:func:`tier_folder_error`). What the modules share stays here in tests/.
"""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

# Every process a test starts (torchrun, its trainers, benchmarks) prints each thread's Python
# stack if it dies of a fatal signal: the first evidence of the Gloo abort at exit that
# apps/core/common/teardown.py now prevents ("terminate called without an active exception").
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

TIERS = ("unit", "integration", "slurm", "gpu", "slow")
#: The order the tiers' modules run in (see pytest_collection_modifyitems): the longest first.
_RUN_ORDER = {"slurm": 0, "integration": 1, "slow": 1, "gpu": 2, "unit": 3}

# Fixtures of the servers on loopback, for any test module to ask for by name.
pytest_plugins = ["testing.moto_server", "tests.gcs_server", "tests.hosts"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Gives each test its tier's marker, so that ``-m unit`` (and the like) selects by tier, and
    runs the modules of the long tiers first: the test workers take whole modules in this order,
    so the quick unit modules fill in at the end instead of one worker finishing a long one alone."""
    items.sort(key=lambda item: _RUN_ORDER.get(getattr(item.module, "TIER", "unit"), 0))  # stable
    for item in items:
        if any(mark.name in TIERS for mark in item.iter_markers()):
            continue
        tier = getattr(item.module, "TIER", None)
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid} has no tier: set TIER to one of {', '.join(TIERS)} in its module, "
                "or mark the test (@pytest.mark.unit, ...)"
            )
        item.add_marker(tier)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Makes a test module that lies outside its tier's folder a collection error naming it and
    the fix, so the run fails. Set on the report of the module's collection, not raised later, so
    that it reads the same with test workers (pytest-xdist) as without."""
    outcome = yield
    report = outcome.get_result()
    if isinstance(collector, pytest.Module) and report.passed:
        error = tier_folder_error(collector.path, getattr(collector.obj, "TIER", None))
        if error:
            report.outcome, report.longrepr, report.result = "failed", error, []


#: The folder that holds the tier folders and what their modules share.
TESTS = pathlib.Path(__file__).resolve().parent


def tier_folder_error(module: pathlib.Path, tier: str | None) -> str | None:
    """Why the test module at ``module`` (absolute) with module-level ``TIER`` ``tier`` lies in the
    wrong folder, in one line naming the fix; None where it lies in tests/<tier>/. A module without
    a known ``TIER`` (every test marked, or a misspelt tier, which the tier check names) is not
    checked here."""
    if tier not in TIERS or module.parent == TESTS / tier:
        return None
    where = pathlib.Path(os.path.relpath(module, TESTS.parent))
    return (
        f"{where} has TIER = {tier!r} but lies in {where.parent}/: move it to tests/{tier}/ "
        f"(git mv {where} tests/{tier}/)"
    )


REPO = str(TESTS.parent)
BIN = os.path.dirname(sys.executable)

# A tiny model that trains in seconds on two CPU processes.
TINY = [
    "--num_embeddings",
    "2000",
    "--batch_size",
    "256",
    "--steps",
    "40",
    "--log_every",
    "20",
    "--val_batches",
    "4",
    "--test_batches",
    "4",
]


#: This environment's ``torchx`` command: its script, or where an environment has none (the lent
#: GPU machines' image, whose staged TorchX brings no scripts) its module, which is the same CLI.
TORCHX = (
    [os.path.join(BIN, "torchx")]
    if os.path.exists(os.path.join(BIN, "torchx"))
    else [sys.executable, "-m", "torchx.cli.main"]
)
#: The README's main job, ``torchx run -s local_cwd components.dlrm:train -j 1x2``, with this
#: environment's torchx: tests append the component's arguments.
LOCAL_TRAIN_1X2 = [*TORCHX, "run", "-s", "local_cwd", "components.dlrm:train", "-j", "1x2"]


def tiny(**overrides) -> list[str]:
    """TINY with some options replaced (TorchX refuses an option given twice)."""
    values = dict(zip(TINY[::2], TINY[1::2]))
    values.update({f"--{name}": str(value) for name, value in overrides.items()})
    return [part for item in values.items() for part in item]


def process_env(**extra: str | None) -> dict[str, str]:
    """This environment for a child process, with ``extra`` set over it (None: unset, as for a job
    run the way a user runs it)."""
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # torchrun and torchx of this venv
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run(
    cmd: list[str], *, timeout: int = 600, cwd: str | None = None, **env: str | None
) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to its end; its exit status is the job's: any failure fails the test."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=process_env(**env))


def torchrun(args: list[str], *, nproc: int = 2, **kwargs) -> subprocess.CompletedProcess:
    return run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        **kwargs,
    )


def torchrun_job(
    args: list[str], out: pathlib.Path, *, nproc: int = 2
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """:func:`torchrun` of a training job's ``args`` whose run folder is ``out``: its result, and
    its summary.json where it wrote one."""
    result = torchrun([*args, "--output_dir", str(out)], nproc=nproc)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return result, summary


def start_torchrun(args: list[str], *, nproc: int = 2, **env: str | None) -> subprocess.Popen:
    """:func:`torchrun` started in the background, its stdout and stderr in one pipe; end it with
    :func:`kill_job`."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        cwd=REPO,
        env=process_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def kill_job(job: subprocess.Popen, marker: str) -> None:
    """SIGKILLs what is left of ``job`` and of its trainers, whose command lines hold ``marker``
    (torchrun's trainers are not its process group's), also after a failed assertion."""
    for pid in [job.pid, *trainer_pids(marker)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait()


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


@pytest.fixture
def tiny_args():
    return list(TINY)


def trainer_pids(marker: str) -> list[int]:
    """Trainer processes (not torchrun itself) whose command line contains ``marker``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if (
            "-m apps.dlrm.train" in cmd
            and marker in cmd
            and "torch.distributed.run" not in cmd
            and "torchrun" not in cmd
        ):
            pids.append(int(pid))
    return pids
