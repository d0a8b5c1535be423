"""One live job per --checkpoint_dir (apps/core/checkpoint/lease.py): a second job started while
the first runs is refused in one line before step 1, naming the folder, the holder and the fix,
and the first finishes with its checkpoints whole (before: the second resumed the first's
checkpoint, took its run id, and the two overwrote each other's commits); a later attempt of the
same job takes the lease at once, any other job only once it has lapsed."""

import json
import os
import re
import sys
import time

import fsspec
import pytest

from apps.core.checkpoint.folder import COMMIT_MARKER, CheckpointStore
from apps.core.checkpoint.lease import LEASE_FILE, Holder, Lease, job_id
from apps.core.checkpoint.storage.errors import CheckpointError
from tests.conftest import assert_ok, kill_job, run, start_torchrun, tiny, torchrun

# Tier (tests/conftest.py): real processes; the lease's own logic is marked unit.
TIER = "integration"

#: Lease timings short enough for tests (seconds), for the jobs these tests start.
FAST_LEASE = {"APPS_LEASE_PERIOD_S": "0.5", "APPS_LEASE_LAPSE_S": "4"}


class FakeTime:
    """A monotonic clock that only the lease's sleeps move, and a hook run at each sleep (another
    job renewing its lease meanwhile)."""

    def __init__(self, on_sleep=lambda: None) -> None:
        self.now, self.on_sleep, self.slept = 0.0, on_sleep, 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        self.on_sleep()

    def clock(self) -> float:
        return self.now


def lease(url: str, fake: FakeTime) -> Lease:
    fs, root = fsspec.core.url_to_fs(url)
    return Lease(fs, root, url, period=5, lapse=30, sleep=fake.sleep, clock=fake.clock)


def holder(job: str, renewed: float | None = None) -> Holder:
    return Holder(job, f"token-{job}", "host-a", 123, time.time() if renewed is None else renewed)


def plant(url: str, who: Holder) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{LEASE_FILE}", "w") as f:
        json.dump(who.__dict__, f)


@pytest.fixture(params=["local", "memory"])
def folder_url(request, tmp_path):
    if request.param == "local":
        (tmp_path / "ckpt").mkdir()  # as CheckpointStore.check_writable makes it, before the lease
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://lease-{os.getpid()}-{time.monotonic_ns()}"
    yield url
    memory = fsspec.filesystem("memory")
    if memory.exists(url):
        memory.rm(url, recursive=True)


@pytest.mark.unit
def test_a_free_folder_is_taken_renewed_and_given_back(folder_url):
    fake = FakeTime()
    mine = lease(folder_url, fake)
    me = holder("job-a")
    mine.take(me)
    assert mine.read() == me and fake.slept < 5  # no watch: nobody held it
    mine.release()
    assert mine.read() is None


@pytest.mark.unit
def test_a_lease_renewed_while_watched_refuses_the_second_job_in_one_line(folder_url):
    first = holder("job-a")
    plant(folder_url, first)
    renewals = iter(range(1, 100))
    fake = FakeTime(lambda: plant(folder_url, Holder(**{**first.__dict__, "renewed": first.renewed + next(renewals)})))
    second = lease(folder_url, fake)
    with pytest.raises(CheckpointError) as refused:
        second.take(holder("job-b"))
    message = str(refused.value)
    assert message.startswith(f"--checkpoint_dir {folder_url} is in use by job job-a (host host-a, pid 123;")
    assert "Wait for that job to end, or give this one another --checkpoint_dir" in message and "\n" not in message
    assert second.read().job == "job-a" and fake.slept <= 5  # refused at the first renewal seen


@pytest.mark.unit
@pytest.mark.parametrize("skew", [0, -3600, 3600], ids=["same-clock", "holder-behind", "holder-ahead"])
def test_a_lease_not_renewed_lapses_and_is_taken_over_whatever_the_holders_clock(folder_url, skew):
    """A dead job's lease is taken once unchanged for the lapse, watched on this host's clock;
    a holder's clock an hour behind shortens the watch to two periods, never below."""
    plant(folder_url, holder("job-a", renewed=time.time() + skew))
    fake = FakeTime()
    second = lease(folder_url, fake)
    second.take(holder("job-b"))
    assert second.read().job == "job-b"
    assert fake.slept >= (10 if skew < 0 else 30)
    second.release()


@pytest.mark.unit
def test_a_lease_renewed_by_a_holder_whose_clock_is_behind_still_refuses(folder_url):
    """The holder's clock an hour behind: its lease looks old, but it changes while watched."""
    first = holder("job-a", renewed=time.time() - 3600)
    plant(folder_url, first)
    fake = FakeTime(lambda: plant(folder_url, Holder(**{**first.__dict__, "renewed": first.renewed + fake.now})))
    with pytest.raises(CheckpointError, match="is in use by job job-a"):
        lease(folder_url, fake).take(holder("job-b"))


@pytest.mark.unit
def test_a_later_attempt_of_the_same_job_takes_the_lease_at_once(folder_url):
    plant(folder_url, holder("dlrm-k3x9f2"))
    fake = FakeTime()
    again = lease(folder_url, fake)
    attempt = Holder("dlrm-k3x9f2", "token-of-attempt-2", "host-b", 456, time.time())
    again.take(attempt)
    assert again.read() == attempt and fake.slept < 5
    again.release()


@pytest.mark.unit
def test_a_job_whose_lease_was_taken_stops_before_its_next_save(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=1)
    store.check_writable()
    store.lease = Lease(store.fs, store.root, store.url, period=0.05, lapse=1)
    store.lease.take(holder("job-a"))
    plant(store.url, holder("job-b"))  # another job took it (its clock said the lease lapsed)
    deadline = time.time() + 10
    while store.lease.lost is None and time.time() < deadline:
        time.sleep(0.05)
    store.run_id = "run-a"
    with pytest.raises(CheckpointError, match=r"this job's lease on the folder was taken \(job job-b"):
        store._claim(10)
    assert not (tmp_path / "ckpt" / "step_00000010").exists()
    store.release()
    assert store.lease is None and Lease(store.fs, store.root, store.url).read().job == "job-b"


@pytest.mark.unit
def test_the_job_id_is_the_same_for_every_attempt_and_differs_between_jobs():
    assert job_id({"TORCHELASTIC_RUN_ID": "dlrm-k3x9f2"}) == "dlrm-k3x9f2"
    bare = job_id({"TORCHELASTIC_RUN_ID": "none"})  # torchrun without --rdzv_id: its agent
    assert bare.endswith(f"-{os.getppid()}") and bare != job_id({})
    assert job_id({}).endswith(f"-{os.getpid()}")  # no torchrun: no restarts, this process


JOB = [
    "-m",
    "apps.dlrm.train",
    *tiny(steps=1500, log_every=500),
    "--checkpoint_every",
    "100",
    "--keep_last",
    "2",
    "--checkpoint_async",
    "false",
]


def test_a_second_live_job_is_refused_and_the_first_finishes_with_its_checkpoints_whole(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*JOB, "--checkpoint_dir", str(ckpt)]
    first = start_torchrun([*args, "--output_dir", str(tmp_path / "first")], **FAST_LEASE)
    try:
        deadline = time.time() + 300
        while not (ckpt / "step_00000100" / COMMIT_MARKER).exists():
            assert first.poll() is None and time.time() < deadline, "the first job ended before its first commit"
            time.sleep(0.05)
        # Through the apps' torchrun, as the components start every job: its last line is the refusal.
        second = run(
            [
                sys.executable,
                "-m",
                "apps.dlrm.torchrun",
                "--standalone",
                "--nproc_per_node",
                "2",
                *args,
                "--output_dir",
                str(tmp_path / "second"),
            ],
            timeout=300,
            **FAST_LEASE,
        )
        assert first.poll() is None, "the first job ended before the second was refused: no overlap was tested"
        log, _ = first.communicate(timeout=600)
    finally:
        kill_job(first, str(ckpt))
    assert second.returncode == 2, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    # Every rank meets the refusal (rank 0 decides it for all): the launcher quotes the first to exit.
    assert re.search(rf"rank [01] exited with 2: --checkpoint_dir {re.escape(str(ckpt))} is in use by job", last), (
        second.stderr[-3000:]
    )
    assert "Wait for that job to end, or give this one another --checkpoint_dir" in last
    assert "Traceback" not in second.stderr
    assert "training steps" not in second.stderr and "resumed from" not in second.stderr
    assert not (tmp_path / "second" / "summary.json").exists()

    assert first.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert summary["steps"] == 1500 and summary["resumed_from_step"] is None
    store = CheckpointStore(str(ckpt), keep_last=2)
    assert store.steps() == [1400, 1500]
    for step in store.steps():
        assert store.at(step) is not None  # committed and whole: every shard its .metadata names
    assert not (ckpt / LEASE_FILE).exists()  # given back at the end


def test_a_lapsed_lease_of_a_job_that_died_is_taken_over_and_the_run_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*JOB[:2], *tiny(steps=20), "--checkpoint_dir", str(ckpt)]
    assert_ok(torchrun([*args, "--output_dir", str(tmp_path / "first")], **FAST_LEASE))
    plant(str(ckpt), holder("a-job-that-was-killed"))  # its trainers died without giving it back
    result = torchrun([*args[:2], *tiny(steps=40), *args[-2:], "--output_dir", str(tmp_path / "second")], **FAST_LEASE)
    assert_ok(result)
    assert "took over the lapsed lease of job a-job-that-was-killed" in result.stderr
    assert json.loads((tmp_path / "second" / "summary.json").read_text())["resumed_from_step"] == 20
