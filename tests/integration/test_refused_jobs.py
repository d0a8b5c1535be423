"""A job refused inside its trainers (a configuration error, exit 2) fails once, whatever
--max_retries says: torchrun does not restart trainers that would be refused again, the
launcher exits 2 (which the Slurm script does not requeue), and TorchX's status holds the
refusal's one line as its ``structured_error_msg`` (before: the trainers were restarted to fail
again, and TorchX said ``structured_error_msg: <NONE>``)."""

import os
import re
import subprocess

import pytest
import yaml
from torchx.runner import get_runner
from torchx.specs.builders import materialize_appdef

from components import dlrm
from tests.conftest import LOCAL_TRAIN_1X2, run, tiny

# Tier (tests/conftest.py): real processes.
TIER = "integration"


def test_a_refusal_in_the_trainers_is_not_retried_and_is_torchx_s_error_message(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "RUN").write_text("other-run\n")  # refused by the trainers, not by the launcher
    result = run([*LOCAL_TRAIN_1X2, *tiny(steps=10), "--max_retries", "2", "--output_dir", str(taken)])
    assert result.returncode != 0 and "job finished: FAILED" in result.stderr, result.stderr[-3000:]
    assert "restarting the trainers" not in result.stderr, result.stderr[-3000:]
    # Every rank meets the refusal (rank 0 decides it for all): the launcher quotes the first to exit.
    refusal = re.compile(rf"rank [01] exited with 2: --output_dir {re.escape(str(taken))} belongs to run other-run \(")
    trainer_lines = [line for line in result.stderr.splitlines() if line.startswith("train/")]
    assert refusal.search(trainer_lines[-1]), result.stderr[-3000:]
    status = yaml.safe_load(result.stderr[result.stderr.index("AppStatus:") :])["AppStatus"]
    message = status["structured_error_msg"]["message"]
    assert refusal.search(message["message"]) and "\n" not in message["message"] and message["errorCode"] == 2
    assert status["num_restarts"] == 0


@pytest.mark.parametrize(
    "exitcode, requeued", [(2, False), (1, True), (137, True)], ids=["refused", "failed", "killed"]
)
def test_slurm_requeues_a_failed_job_but_not_a_refused_one(tmp_path, monkeypatch, exitcode, requeued):
    """The sbatch script, run as Slurm runs it (a fake srun exiting as the launchers did, a fake
    scontrol recording what it is asked), with retries left: a refusal ends the job, anything
    else requeues it."""
    app = materialize_appdef(dlrm.train, ["-j", "1x1", "--max_retries", "2"])
    for tool, script in {"srun": f"exit {exitcode}", "scontrol": f'echo "$@" >> {tmp_path}/scontrol.calls'}.items():
        (tmp_path / "bin" / tool).parent.mkdir(exist_ok=True)
        (tmp_path / "bin" / tool).write_text(f"#!/bin/bash\n{script}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.chdir(tmp_path)
    with get_runner() as runner:
        script = runner.dryrun(app, "slurm", cfg={}, workspace=None).request.materialize()
    (tmp_path / "job.sh").write_text(script)
    path = f"{tmp_path}/bin:{os.environ['PATH']}"
    ran = subprocess.run(
        ["bash", "job.sh"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": path, "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0"},
    )
    assert ran.returncode == exitcode, ran.stderr
    calls = (tmp_path / "scontrol.calls").read_text() if (tmp_path / "scontrol.calls").exists() else ""
    assert calls == ("requeue 42\n" if requeued else "")
