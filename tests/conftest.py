"""Helpers for tests that start real processes (torchrun, torchx)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

# A tiny model that trains in seconds on two CPU processes.
TINY = [
    "--num_embeddings", "2000", "--batch_size", "256", "--steps", "40", "--log_every", "20",
    "--val_batches", "4", "--test_batches", "4",
]


def tiny(**overrides) -> list[str]:
    """TINY with some options replaced (TorchX refuses an option given twice)."""
    values = dict(zip(TINY[::2], TINY[1::2]))
    values.update({f"--{name}": str(value) for name, value in overrides.items()})
    return [part for item in values.items() for part in item]


def process_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # torchrun and torchx of this venv
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str], *, timeout: int = 600, cwd: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to its end; its exit status is the job's: any failure fails the test."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=process_env(**env)
    )


def torchrun(args: list[str], *, nproc: int = 2, **kwargs) -> subprocess.CompletedProcess:
    return run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        **kwargs,
    )


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
        if "-m apps.dlrm.train" in cmd and marker in cmd and "torch.distributed.run" not in cmd and "torchrun" not in cmd:
            pids.append(int(pid))
    return pids
