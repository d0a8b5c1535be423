"""A job refused inside its trainers (a configuration error, exit 2) fails once, whatever
--max_retries says: torchrun does not restart trainers that would be refused again, the
launcher exits 2 (which the Slurm script does not requeue), and TorchX's status holds the
refusal's one line as its ``structured_error_msg`` (before: the trainers were restarted to fail
again, and TorchX said ``structured_error_msg: <NONE>``)."""

import yaml

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
    refusal = f"rank 0 exited with 2: --output_dir {taken} belongs to run other-run (its RUN file)"
    trainer_lines = [line for line in result.stderr.splitlines() if line.startswith("train/")]
    assert refusal in trainer_lines[-1], result.stderr[-3000:]
    status = yaml.safe_load(result.stderr[result.stderr.index("AppStatus:") :])["AppStatus"]
    message = status["structured_error_msg"]["message"]
    assert refusal in message["message"] and "\n" not in message["message"] and message["errorCode"] == 2
    assert status["num_restarts"] == 0
