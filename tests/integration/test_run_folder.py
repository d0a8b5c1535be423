"""One folder per run (apps/core/training/run_folder.py): the default --output_dir gives every run
a folder of its own under outputs/, ``outputs/latest`` points at the newest that trains or
evaluates, Slurm writes the job's logs into it, and no run writes into another run's folder or
over a user's files.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest
from torchx.runner import get_runner
from torchx.schedulers import slurm_scheduler
from torchx.schedulers.api import Stream
from torchx.specs.builders import materialize_appdef

from apps.core.common.errors import ConfigError
from apps.core.training.run_folder import (
    TORCHRUN_LOGS,
    make_run_folder,
    output_folder,
    point_latest_at,
    torchrun_log_dir,
)
from apps.dlrm.config import train_config
from components import dlrm
from schedulers.slurm import SlurmScheduler
from tests.conftest import LOCAL_TRAIN_1X2, TINY, assert_ok, run, tiny

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

NOON = datetime.datetime(2025, 6, 1, 12, 0, 0)
#: What a job that TorchX started on local_cwd sees (its app id is the rendezvous id).
LOCAL_CWD = {"TORCHX_JOB_ID": "local_cwd://torchx/dlrm-k3x9f2", "TORCHELASTIC_RUN_ID": "dlrm-k3x9f2"}
#: What a torchrun that restarted its trainers tells them.
RESTARTED = {"TORCHELASTIC_RESTART_COUNT": "1"}


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def entries(folder) -> list[str]:
    """Everything under ``folder``, empty folders too (torchrun makes one per attempt and rank)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.unit
def test_runs_started_in_the_same_second_get_folders_of_their_own_and_latest_the_newest(tmp_path):
    out = str(tmp_path / "outputs" / "{run}")
    first = make_run_folder(out, "run-a", False, {}, NOON, "dlrm")
    second = make_run_folder(out, "run-b", False, {}, NOON, "dlrm")
    assert first == str(tmp_path / "outputs" / "dlrm-20250601-120000")
    assert second == first + "-2"
    assert not os.path.lexists(tmp_path / "outputs" / "latest")  # not before a run trains or evaluates
    point_latest_at(out, first)
    point_latest_at(out, second)
    assert os.readlink(tmp_path / "outputs" / "latest") == "dlrm-20250601-120000-2"  # relative: the folder can move
    assert (tmp_path / "outputs" / "dlrm-20250601-120000" / "RUN").read_text() == "run-a\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ, name",
    [
        (LOCAL_CWD | {"TORCHX_TRACKING_RUN_NAME": "dlrm"}, "dlrm-k3x9f2"),  # local_cwd: the app id has the name
        (
            {"TORCHX_JOB_ID": "slurm://torchx/1234", "TORCHELASTIC_RUN_ID": "1234", "TORCHX_TRACKING_RUN_NAME": "ctr"},
            "ctr-1234",
        ),
        ({"TORCHELASTIC_RUN_ID": "demo"}, "dlrm-20250601-120000"),  # a bare torchrun's --rdzv_id: reused at will
        ({"TORCHX_JOB_ID": "x", "TORCHELASTIC_RUN_ID": "../../etc", "TORCHX_TRACKING_RUN_NAME": "a/b"}, "a_b-_.._etc"),
    ],
)
def test_a_run_is_named_by_its_torchx_app_id_else_by_its_start(tmp_path, environ, name):
    folder = make_run_folder(str(tmp_path / "{run}"), "r", False, environ, NOON, "dlrm")
    assert folder == str(tmp_path / name)
    assert os.path.dirname(folder) == str(tmp_path)


@pytest.mark.unit
def test_a_restarted_job_goes_on_in_its_folder_and_a_new_job_never_does(tmp_path):
    out = str(tmp_path / "{run}")
    folder = make_run_folder(out, "dlrm-k3x9f2", False, LOCAL_CWD, NOON, "dlrm")
    (tmp_path / "dlrm-k3x9f2" / "summary.json").write_text("{}")  # it ended, then a trainer failed
    assert make_run_folder(out, "dlrm-k3x9f2", False, LOCAL_CWD | RESTARTED, NOON, "dlrm") == folder
    # The same id, not a restart nor a resume (a rerun of a bare torchrun --rdzv_id, a reused Slurm job id)
    with pytest.raises(ConfigError, match="holds the summary.json of run dlrm-k3x9f2, which ended"):
        make_run_folder(out, "dlrm-k3x9f2", False, LOCAL_CWD, NOON, "dlrm")


@pytest.mark.unit
def test_a_run_resuming_from_its_checkpoint_may_write_into_its_own_folder(tmp_path):
    out = str(tmp_path / "results")
    make_run_folder(out, "run-a", False, {}, NOON, "dlrm")
    (tmp_path / "results" / "summary.json").write_text("{}")
    assert make_run_folder(out, "run-a", True, {}, NOON, "dlrm") == out


@pytest.mark.unit
@pytest.mark.parametrize(
    "owner, summary, message",
    [
        ("run-a\n", None, "--output_dir {folder} belongs to run run-a (its RUN file), not to this run (run-b)"),
        ("run-a\n", "{}", "--output_dir {folder} belongs to run run-a"),
        (None, "{}", "--output_dir {folder} holds the summary.json of a run that ended"),  # before RUN files
    ],
    ids=["another-run-running", "another-run-ended", "a-run-of-an-older-version"],
)
def test_a_folder_of_another_run_is_refused_and_left_as_it_was(tmp_path, owner, summary, message):
    folder = tmp_path / "results"
    folder.mkdir()
    if owner is not None:
        (folder / "RUN").write_text(owner)
    if summary is not None:
        (folder / "summary.json").write_text(summary)
    before = files(tmp_path)
    for resuming in (False, True):
        with pytest.raises(ConfigError) as refused:
            make_run_folder(str(folder), "run-b", resuming, RESTARTED, NOON, "dlrm")
        assert str(refused.value).startswith(message.format(folder=folder))
        assert "--output_dir" in str(refused.value).split(": ", 1)[1] and "\n" not in str(refused.value)  # the fix
    assert files(tmp_path) == before


@pytest.mark.unit
def test_a_given_folder_new_or_empty_is_taken_and_a_latest_that_is_no_link_is_the_users(tmp_path):
    # A new folder, an empty one, and one holding only what the job wrote before its trainers
    # (torchrun's logs, Slurm's of this job) are the run's; no link is made beside them.
    (tmp_path / "empty").mkdir()
    (tmp_path / "launched" / "torchrun").mkdir(parents=True)
    (tmp_path / "launched" / "slurm-42.out").write_text("")
    (tmp_path / "launched" / "slurm-42-train-0.err").write_text("")
    for name in ("new", "empty", "launched"):
        folder = str(tmp_path / name)
        assert make_run_folder(folder, "run-a", False, {"SLURM_JOB_ID": "42"}, NOON, "dlrm") == folder
        assert (tmp_path / name / "RUN").read_text() == "run-a\n"
    assert not (tmp_path / "latest").exists()
    # Something of the user's named latest is never replaced by the link.
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "latest").write_text("mine")
    out = str(tmp_path / "outputs" / "{run}")
    point_latest_at(out, make_run_folder(out, "run-b", False, {}, NOON, "dlrm"))
    assert (tmp_path / "outputs" / "latest").read_text() == "mine"


@pytest.mark.unit
@pytest.mark.parametrize(
    "theirs",
    [["notes.txt"], ["metrics.jsonl", "plan.txt"], ["slurm-41.out"], ["a", "b", "c", "d"]],
    ids=["notes", "a-runs-files", "another-jobs-log", "many"],
)
def test_a_folder_of_the_users_files_is_refused_in_one_line_and_left_as_it_was(tmp_path, theirs):
    """A folder of no run (no RUN file) holding files: a run's results never mix with them (a run
    writes plan.txt and appends to metrics.jsonl). Refused by the launcher, before torchrun writes
    its logs there, as by the trainer, in a message that says the files are no run's."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in theirs:
        (folder / name).write_text("precious")
    before = files(tmp_path)
    shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
    message = (
        f"--output_dir {folder} is not a run's folder (it has no RUN file) and holds files ({shown}) that no run wrote"
    )
    for refuse in (
        lambda: make_run_folder(str(folder), "run-a", False, {"SLURM_JOB_ID": "42"}, NOON, "dlrm"),
        lambda: torchrun_log_dir(
            str(folder / TORCHRUN_LOGS), LOCAL_CWD | {"SLURM_JOB_ID": "42"}, "dlrm-k3x9f2", "dlrm"
        ),
    ):
        with pytest.raises(ConfigError) as refused:
            refuse()
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
        assert "write over" not in str(refused.value)
        assert "give a new or empty folder, or leave --output_dir at its default" in str(refused.value)
    assert files(tmp_path) == before and sorted(os.listdir(folder)) == sorted(theirs)


@pytest.mark.unit
def test_an_unwritable_output_dir_is_refused_in_one_line_by_the_launcher_and_the_trainer(tmp_path):
    """/sys refuses new folders even to root (EPERM), as a read-only mount or another user's folder
    refuses this job's: before, torchrun's or the trainer's traceback."""
    for output_dir in ("/sys/h36-no-such-run", "/sys/h36-no-such-runs/{run}"):
        for refuse, args in (
            (torchrun_log_dir, (os.path.join(output_dir, TORCHRUN_LOGS), LOCAL_CWD, "dlrm-k3x9f2", "dlrm")),
            (make_run_folder, (output_dir, "run-a", False, LOCAL_CWD, NOON, "dlrm")),
        ):
            with pytest.raises(ConfigError) as refused:
                refuse(*args)
            message = str(refused.value)
            assert message.startswith("--output_dir /sys/h36-no-such-run") and "cannot be written (" in message
            assert "give a folder this job can write to" in message and "\n" not in message


@pytest.mark.unit
def test_torchrun_never_logs_into_a_folder_of_another_run(tmp_path):
    """The launcher cannot tell a run resuming a folder's run (from its checkpoint) from another
    run, which its trainers refuse: torchrun's logs go into a folder of another run's only once
    it is this job's (a requeued job's), else to torchrun's own temporary folder."""
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "RUN").write_text("run-a\n")
    logs = str(folder / TORCHRUN_LOGS)
    assert torchrun_log_dir(logs, LOCAL_CWD, "dlrm-k3x9f2", "dlrm") == ""
    assert torchrun_log_dir(logs, LOCAL_CWD, "run-a", "dlrm") == logs  # this job's first attempt claimed it
    assert torchrun_log_dir(str(tmp_path / "new" / TORCHRUN_LOGS), LOCAL_CWD, "dlrm-k3x9f2", "dlrm").startswith(
        str(tmp_path)
    )
    assert os.listdir(folder) == ["RUN"]
    assert os.listdir(tmp_path / "new") == []  # made (torchrun writes there next), nothing in it


@pytest.mark.unit
@pytest.mark.parametrize("output_dir", ["runs/{run}/x", "runs/{run}-x", "{run}/{run}"])
def test_run_must_be_the_last_folders_whole_name(output_dir):
    with pytest.raises(ConfigError, match=r"^--output_dir '.*': \{run\} stands for the whole name of the last folder"):
        train_config(output_dir=output_dir)


@pytest.mark.unit
def test_the_component_and_the_app_name_a_slurm_jobs_folder_alike(tmp_path):
    """The folder the Slurm script puts the logs in is the one the trainers write to."""
    (role,) = materialize_appdef(dlrm.train, ["--name", "ctr/dlrm1"]).roles
    assert role.metadata["slurm/log_dir"] == "outputs/dlrm1-${app_id}"
    seen_by_the_app = dict(role.env, TORCHX_JOB_ID="slurm://torchx/42", TORCHELASTIC_RUN_ID="42")
    folder = make_run_folder(str(tmp_path / "outputs" / "{run}"), "42", False, seen_by_the_app, NOON, "dlrm")
    assert folder == str(tmp_path / role.metadata["slurm/log_dir"].replace("${app_id}", "42"))
    assert output_folder("", "dlrm", "42") == ""  # --output_dir "": no folder, and no log folder
    assert "slurm/log_dir" not in materialize_appdef(dlrm.train, ["--output_dir", ""]).roles[0].metadata


@pytest.mark.unit
@pytest.mark.parametrize(
    "scheduler_env",
    [LOCAL_CWD, {"TORCHX_JOB_ID": "slurm://torchx/42", "TORCHELASTIC_RUN_ID": "42"}],
    ids=["local_cwd", "slurm"],
)
def test_torchruns_logs_go_into_the_run_folder_the_trainers_write(tmp_path, scheduler_env):
    """The component gives torchrun's --log_dir as <--output_dir>/torchrun; apps.dlrm.torchrun names
    its {run} by the job's rendezvous id, as the trainers name their folder."""
    (role,) = materialize_appdef(dlrm.train, ["--output_dir", str(tmp_path / "{run}")]).roles
    seen = dict(role.env, **scheduler_env)
    log_dir = torchrun_log_dir(seen["PET_LOG_DIR"], seen, rdzv_id=scheduler_env["TORCHELASTIC_RUN_ID"], app="dlrm")
    assert log_dir == os.path.join(
        make_run_folder(str(tmp_path / "{run}"), "r", False, seen, NOON, "dlrm"), TORCHRUN_LOGS
    )
    assert (
        torchrun_log_dir(seen["PET_LOG_DIR"], {}, rdzv_id="demo", app="dlrm") == ""
    )  # no TorchX job: torchrun's own folder
    assert torchrun_log_dir("/given/logs", seen, rdzv_id="42", app="dlrm") == "/given/logs"
    (role,) = materialize_appdef(dlrm.train, ["--env", "PET_LOG_DIR=/mine"]).roles
    assert role.env["PET_LOG_DIR"] == "/mine"


def test_slurm_writes_the_jobs_logs_into_its_run_folder_and_torchx_log_reads_them(tmp_path, monkeypatch):
    """The sbatch script, run as Slurm runs it (a fake sbatch and srun): the logs of every
    replica and the script's own go into outputs/dlrm-42, none into the submitting directory."""
    app = materialize_appdef(dlrm.train, ["-j", "2x1"])
    for tool, script in {
        "sbatch": "echo 42",
        "srun": f"printf '%s\\0' \"$@\" > {tmp_path}/srun.argv",
        "sinfo": "exit 1",
    }.items():
        (tmp_path / "bin" / tool).parent.mkdir(exist_ok=True)
        (tmp_path / "bin" / tool).write_text(f"#!/bin/bash\n{script}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}/bin:{os.environ['PATH']}")
    job = tmp_path / "job"
    job.mkdir()
    monkeypatch.chdir(job)
    with get_runner() as runner:
        info = runner.dryrun(app, "slurm", cfg={}, workspace=None)
        assert SlurmScheduler("test").schedule(info) == "42"
    (job / "slurm-42.out").write_text("the script's own output so far\n")  # sbatch's default file
    (job / "job.sh").write_text(info.request.materialize())
    ran = subprocess.run(
        ["bash", "job.sh"], capture_output=True, text=True, timeout=30, env={**os.environ, "SLURM_JOB_ID": "42"}
    )
    assert ran.returncode == 0, ran.stderr
    folder = job / "outputs" / "dlrm-42"
    assert not list(job.glob("slurm-*"))  # no log left in the submitting directory
    assert (folder / "slurm-42.out").read_text() == "the script's own output so far\n"
    argv = (tmp_path / "srun.argv").read_text().split("\0")
    for replica in ("train-0", "train-1"):
        assert f"--output=outputs/dlrm-42/slurm-42-{replica}.out" in argv
        assert f"--error=outputs/dlrm-42/slurm-42-{replica}.err" in argv
    # `torchx log` looks for slurm-42-train-0.err where the job wrote it.
    (folder / "slurm-42-train-0.err").write_text("step 40/40\n")
    lines = SlurmScheduler("test").log_iter("42", "train", 0, streams=Stream.STDERR)
    assert [line.rstrip("\n") for line in lines] == ["step 40/40"]
    assert slurm_scheduler._get_job_dirs()["42"] == str(folder)


def test_two_runs_never_share_a_folder(tmp_path):
    """The README's main job twice from one directory: two folders under outputs/, each with its
    own summary.json and TensorBoard run, latest at the second; a third run pointed at the
    first's folder is refused in one line before it trains, and the first's results stay."""
    job = [*LOCAL_TRAIN_1X2[:-1], "1", *tiny(steps=20)]  # -j 1: one trainer, the job's folder is the point
    handles = []
    for _ in range(2):
        result = run(job, cwd=str(tmp_path))
        assert_ok(result)
        handles.append(result.stdout.strip().splitlines()[-1])
    outputs = tmp_path / "outputs"
    names = [handle.rsplit("/", 1)[-1] for handle in handles]  # local_cwd://torchx/dlrm-k3x9f2
    assert sorted(os.listdir(outputs)) == sorted([*names, "latest"]) and names[0] != names[1]
    assert os.readlink(outputs / "latest") == names[1]
    for name in names:
        summary = json.loads((outputs / name / "summary.json").read_text())
        assert summary["run_id"] == name and summary["steps"] == 20
        assert len(os.listdir(outputs / name / "tensorboard")) == 1  # one run's event file
    first = files(outputs / names[0])

    third = run(
        [sys.executable, "-m", "apps.dlrm.train", *TINY, "--output_dir", str(outputs / names[0])], cwd=str(tmp_path)
    )
    assert third.returncode == 2, third.stderr[-3000:]
    (line,) = [line for line in third.stderr.splitlines() if "ERROR" in line]
    assert f"--output_dir {outputs / names[0]} belongs to run {names[0]}" in line, third.stderr[-3000:]
    assert "training steps" not in third.stderr
    assert files(outputs / names[0]) == first


#: One trainer, a few steps: these jobs are about their folders.
SHORT_JOB = [*LOCAL_TRAIN_1X2[:-1], "1x1", *tiny(steps=5)]


def test_a_folder_of_the_users_files_is_refused_before_the_job_writes_anything(tmp_path):
    """The user's files in a folder given as --output_dir: the job fails in one line naming the
    folder and the fix, before torchrun or a trainer writes there (it wrote over plan.txt,
    appended to metrics.jsonl, then failed drawing the curves)."""
    mine = tmp_path / "myexp"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("precious line\n")
    (mine / "plan.txt").write_text("precious plan\n")
    before = files(tmp_path)
    result = run([*SHORT_JOB, "--output_dir", str(mine)])
    assert result.returncode != 0 and "FAILED" in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "not a run's folder" in line]
    assert f"--output_dir {mine} is not a run's folder (it has no RUN file)" in line
    assert line.endswith(
        "give a new or empty folder, or leave --output_dir at its default (a new folder per run under outputs/)"
    )
    assert "training steps" not in result.stderr
    assert files(tmp_path) == before and sorted(os.listdir(mine)) == ["metrics.jsonl", "plan.txt"]


def test_checkpoints_inside_the_runs_folder_are_the_runs_own(tmp_path):
    """``--output_dir D --checkpoint_dir D/ckpt`` (torchtitan's layout): the checkpoint folder,
    made first, is the run's, not a file of the user's; the run trains, saves there, and the same
    command resumes it. Before: refused as "holds files (ckpt) that a run would write over"."""
    folder = tmp_path / "exp"
    job = [*SHORT_JOB, "--output_dir", str(folder), "--checkpoint_dir", str(folder / "ckpt")]
    assert_ok(run(job))
    assert (folder / "ckpt" / "step_00000005" / "COMMITTED").exists()
    assert json.loads((folder / "summary.json").read_text())["steps"] == 5
    again = run([*job[: job.index("--steps") + 1], "8", *job[job.index("--steps") + 2 :]])
    assert_ok(again)
    assert json.loads((folder / "summary.json").read_text())["resumed_from_step"] == 5


@pytest.mark.unit
def test_a_checkpoint_folder_inside_counts_as_the_runs_only_when_it_is_its_checkpoint_dir(tmp_path):
    folder = tmp_path / "exp"
    (folder / "ckpt").mkdir(parents=True)
    assert make_run_folder(str(folder), "run-a", False, {}, NOON, "dlrm", str(folder / "ckpt")) == str(folder)
    other = tmp_path / "other"
    (other / "ckpt").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds files \(ckpt\) that no run wrote"):
        make_run_folder(str(other), "run-b", False, {}, NOON, "dlrm", str(tmp_path / "elsewhere"))


def test_runs_without_results_leave_latest_and_the_finished_runs_folder_as_they_were(tmp_path):
    """After a finished run, a rerun with nothing left to do, a run that fails at start-up and a
    run pointed at the finished run's folder: latest still leads to the finished run's results,
    the rerun says where they are, and nothing is written into the finished run's folder."""
    outputs = tmp_path / "outputs"
    job = [*SHORT_JOB, "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(outputs / "{run}")]
    first = run(job)
    assert_ok(first)
    name = os.readlink(outputs / "latest")
    finished, finished_entries = files(outputs / name), entries(outputs / name)
    summary = outputs / name / "summary.json"

    again = run(job)
    assert_ok(again)
    assert f"its results stay as they are: {summary}" in again.stderr, again.stderr[-3000:]
    (rerun,) = set(os.listdir(outputs)) - {name, "latest"}
    assert sorted(os.listdir(outputs / rerun)) == ["RUN", TORCHRUN_LOGS]  # its launcher's logs only

    broken = run(
        [*SHORT_JOB, "--data", "criteo", "--data_path", str(tmp_path / "none"), "--output_dir", str(outputs / "{run}")]
    )
    assert broken.returncode != 0 and "training steps" not in broken.stderr, broken.stderr[-3000:]

    refused = run([*SHORT_JOB, "--output_dir", str(outputs / name)])
    assert refused.returncode != 0 and f"--output_dir {outputs / name} belongs to run {name}" in refused.stderr

    assert os.readlink(outputs / "latest") == name
    assert json.loads((outputs / "latest" / "summary.json").read_text())["steps"] == 5
    assert files(outputs / name) == finished and entries(outputs / name) == finished_entries


def test_a_run_that_torchx_did_not_name_is_named_after_its_app(tmp_path):
    """``python -m apps.hstu.train`` alone (no TorchX, so no job name): its folder under outputs/
    is the HSTU's, ``hstu-<start>``, not another app's."""
    result = run(
        [sys.executable, "-m", "apps.hstu.train", "--steps", "2", "--val_batches", "1", "--test_batches", "1"],
        cwd=str(tmp_path),
    )
    assert_ok(result)
    (folder,) = [name for name in os.listdir(tmp_path / "outputs") if name != "latest"]
    assert folder.startswith("hstu-") and json.loads((tmp_path / "outputs" / folder / "summary.json").read_text())
