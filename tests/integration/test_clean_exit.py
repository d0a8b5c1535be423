"""A job that finished its work ends SUCCEEDED, every time.

A rank used to abort at exit now and then ("terminate called without an active exception",
SIGABRT) after writing summary.json, so the scheduler reported FAILED: the Criteo loader's
prefetch thread was still building a batch inside a torch call when the interpreter shut down,
and was killed as it took the GIL back. Training now closes its data iterators, which join their
threads, before the process exits.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import LOCAL_TRAIN_1X2, REPO, assert_ok, process_env, run, tiny
from tests.unit.test_criteo_data import write_folder

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("criteo"), [3000, 3000, 3000, 2000], sizes=2000)


def test_training_leaves_no_thread_running(criteo, tmp_path):
    """The cause itself: after the app's main returns, only the main thread is left. (And the
    trainer imported its machinery out of the garbage collector's way, which it runs with on.)"""
    code = (
        "import gc, sys, threading\n"
        "from apps.dlrm.train import main\n"
        "print('collector:', gc.isenabled(), gc.get_freeze_count() > 100_000)\n"
        "main(sys.argv[1:])\n"
        "print('threads:', sorted(t.name for t in threading.enumerate()))\n"
    )
    args = tiny(data="criteo", data_path=criteo, val_every_steps=20, output_dir=tmp_path / "out")
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=process_env()
    )
    assert_ok(result)
    assert "threads: ['MainThread']" in result.stdout, result.stdout[-2000:]
    assert "collector: True True" in result.stdout, result.stdout[-2000:]


def torchx_job(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess:
    return run(
        [
            *LOCAL_TRAIN_1X2,
            "--output_dir",
            str(tmp_path / name),
            *args,
        ],
        cwd=str(tmp_path),
        timeout=300,
    )


def test_short_jobs_all_end_succeeded(criteo, tmp_path):
    """Three rounds of two jobs at once, one per data kind: the load under which ranks aborted
    (the cause itself is checked directly above)."""
    jobs = []
    for i in range(3):
        jobs.append((f"synthetic{i}", tiny(seed=i)))
        jobs.append((f"criteo{i}", tiny(seed=i, data="criteo", data_path=criteo, epochs=3)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: torchx_job(tmp_path, job[0], *job[1]), jobs))
    for (name, _), result in zip(jobs, results):
        assert result.returncode == 0 and "job finished: SUCCEEDED" in result.stderr + result.stdout, (
            f"{name}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
        assert json.loads((tmp_path / name / "summary.json").read_text())["steps"] == 40


def test_a_job_that_fails_on_bad_input_says_why_once_without_a_traceback_wall(tmp_path):
    # A URL, which only the job reads (a local path this machine lacks is refused at submission):
    # an empty fsspec memory filesystem stands in for a bucket without the data.
    result = torchx_job(tmp_path, "bad", "--data", "parquet", "--data_path", "memory://nonexistent/")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "job finished: FAILED" in out
    # Once in the job's log, and once as the error TorchX's closing status reports
    # (structured_error_msg, from torchrun's error file), as `torchx status` does.
    log, _, status = out.partition("AppStatus:")
    assert log.count("--data_path memory://nonexistent/ does not exist") == 1, out[-3000:]
    assert "apps.dlrm.torchrun: apps.dlrm.train failed on" in log
    error = " ".join(status.partition("structured_error_msg:")[2].split())
    assert "message: 'apps.dlrm.torchrun: apps.dlrm.train failed on" in error, out[-3000:]
    assert error.count("--data_path memory://nonexistent/ does not exist") == 1, out[-3000:]
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
