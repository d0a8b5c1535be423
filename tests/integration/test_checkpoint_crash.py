"""A crash in the middle of writing a checkpoint: the last committed one stays whole and is what
the next run resumes from; nothing half-written is ever taken for one (issue: crash-safe saves)."""

import json
import os
import signal
import subprocess
import time

import pytest

from apps.core.checkpoint.folder import COMMIT_MARKER, CheckpointStore
from tests.conftest import assert_ok, kill_job, start_torchrun, torchrun, trainer_pids

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

#: ~1 GB of tables, so that writing a checkpoint takes seconds: long enough to be caught mid-write.
BIG_TABLES = [
    "--num_sparse_features",
    "8",
    "--num_embeddings",
    "500000",
    "--embedding_dim",
    "64",
    "--dense_arch_layer_sizes",
    "64,64",
    "--batch_size",
    "128",
    "--steps",
    "30",
    "--checkpoint_every",
    "10",
    "--keep_last",
    "1",
    "--log_every",
    "10",
    "--val_batches",
    "2",
    "--test_batches",
    "2",
    "--sharding_type",
    "table_wise",
]


def step_dir(ckpt, step: int):
    return ckpt / f"step_{step:08d}"


def wait_for(condition, job: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def being_written(folder) -> bool:
    """Shard files are open in ``folder`` and the checkpoint is not committed."""
    names = os.listdir(folder) if folder.exists() else []
    return any(name.endswith(".distcp") for name in names) and COMMIT_MARKER not in names


@pytest.mark.parametrize("victim", ["one rank", "whole job"])
def test_a_crash_while_saving_keeps_the_last_good_checkpoint_and_resumes_from_it(victim, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["-m", "apps.dlrm.train", *BIG_TABLES, "--checkpoint_dir", str(ckpt)]
    job = start_torchrun([*args, "--output_dir", str(tmp_path / "first")])
    try:
        wait_for(lambda: (step_dir(ckpt, 10) / COMMIT_MARKER).exists(), job, "first commit")
        wait_for(lambda: being_written(step_dir(ckpt, 20)), job, "second checkpoint being written")
        trainers = trainer_pids(str(ckpt))
        for pid in trainers[:1] if victim == "one rank" else [job.pid, *trainers]:
            os.kill(pid, signal.SIGKILL)
        assert not (step_dir(ckpt, 20) / COMMIT_MARKER).exists(), "killed too late: it was committed"
        log, _ = job.communicate(timeout=120)
    finally:
        kill_job(job, str(ckpt))
    assert job.returncode != 0, log[-3000:]

    # What is on disk: the half-written step 20 does not count; step 10 is whole.
    store = CheckpointStore(str(ckpt), keep_last=1)
    assert store.newest().step == 10
    assert (step_dir(ckpt, 10) / COMMIT_MARKER).exists()

    # The same command again resumes from step 10, rewrites step 20, and keeps the last
    # (--keep_last 1) and step 10, which its load verified: the last checkpoint known to be good.
    result = torchrun([*args, "--output_dir", str(tmp_path / "second")], timeout=600)
    assert_ok(result)
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 30
    assert sorted(os.listdir(ckpt)) == ["BEST", "step_00000010", "step_00000030"]  # BEST: the one validation's
    assert store.newest().step == 30
