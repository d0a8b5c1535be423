"""One live job per checkpoint folder: the lease a job holds on ``--checkpoint_dir`` while it runs.

Two live jobs writing one folder would resume each other's checkpoints, take each other's run id
and overwrite each other's commits. So rank 0 of a job that trains takes the folder's ``LEASE``
file before it reads any checkpoint, and a thread renews it every :data:`PERIOD_S` seconds until
the job ends (:meth:`Lease.release` deletes it). A job that finds the lease of another live job is
refused in one line, naming the folder, the holder and what to do.

Who may take a lease held by another process:

- a later attempt of the same job, at once: torchrun's restarts and the scheduler's retries keep
  the job's id (``TORCHELASTIC_RUN_ID``: TorchX gives torchrun its app id; a bare torchrun with
  no id is told apart by its agent's host and pid), and the attempt before it is gone;
- any other job only once the lease has lapsed: not renewed for :data:`LAPSE_S`. A job that
  finds another's lease watches it: renewed meanwhile, the holder is live and the job is refused
  (within about a period); unchanged for the lapse, its holder is gone (a job killed, a host
  lost) and the job takes the folder over, saying so. Run again at once after a crash, the same
  command so waits out the rest of the lapse, then resumes.

Object stores (``s3://``, ``gs://``, ``memory://``) have no locks, and hosts' clocks may
disagree: a lease is judged by watching it change on this host's clock alone. The holder's clock
only shortens the watch of a lease that says it was renewed long ago (never below two periods, in
which a live holder renews it): skew can delay a takeover, never let two live jobs share the
folder. Two jobs taking a lapsed lease at the same moment: each writes its own, waits, and reads
it back; the one whose write did not stay is refused. A holder's renewal thread also reads the
lease back each time, and a job whose lease was taken stops before its next save
(:meth:`Lease.check_held`) rather than write over the new holder's checkpoints.

The period and the lapse may be shortened for tests through the environment
(``APPS_LEASE_PERIOD_S``, ``APPS_LEASE_LAPSE_S``); they are not options of the jobs.
"""

import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from fsspec import AbstractFileSystem

from apps.core.checkpoint.storage.errors import CheckpointError

logger = logging.getLogger(__name__)

#: The leases this process holds: a job that fails before its Checkpointer closes (a refused
#: option, bad data) gives them up in its command's last step (:func:`release_held`).
_HELD: "set[Lease]" = set()

#: The lease's file at the root of --checkpoint_dir.
LEASE_FILE = "LEASE"
#: Seconds between renewals.
PERIOD_S = float(os.environ.get("APPS_LEASE_PERIOD_S", 5))
#: Seconds without a renewal after which another job may take the lease.
LAPSE_S = float(os.environ.get("APPS_LEASE_LAPSE_S", 30))


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: ``job`` (the same for every attempt of one job), ``token`` (this
    process's, new for every attempt), where it runs, and when (its clock) it last renewed."""

    job: str
    token: str
    host: str
    pid: int
    renewed: float

    @classmethod
    def of_this_process(cls, environ: dict[str, str] | None = None) -> "Holder":
        environ = dict(os.environ if environ is None else environ)
        return cls(job_id(environ), uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time())

    def describe(self) -> str:
        renewed = time.strftime("%H:%M:%S UTC", time.gmtime(self.renewed))
        return f"job {self.job} (host {self.host}, pid {self.pid}; last renewed {renewed})"


def job_id(environ: dict[str, str]) -> str:
    """The id every attempt of this job shares: torchrun's rendezvous id (TorchX's app id); for a
    bare torchrun without one, its agent on this host (the trainers' parent process, which
    restarts them); outside torchrun, which restarts nothing, this process."""
    rendezvous = environ.get("TORCHELASTIC_RUN_ID")
    if rendezvous is None:
        return f"process-{socket.gethostname()}-{os.getpid()}"
    return rendezvous if rendezvous != "none" else f"torchrun-{socket.gethostname()}-{os.getppid()}"


class Lease:
    """The lease of ``--checkpoint_dir`` (``fs``, ``root``; ``url`` for messages), taken by
    :meth:`take` (rank 0, before any checkpoint is read), renewed in a thread, given up by
    :meth:`release`. ``sleep`` and ``clock`` (monotonic) are time's; tests pass time with theirs."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        url: str,
        period: float = PERIOD_S,
        lapse: float = LAPSE_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fs, self.path, self.url = fs, posixpath.join(root, LEASE_FILE), url
        self.period, self.lapse, self.sleep, self.clock = period, lapse, sleep, clock
        self.holder: Holder | None = None
        #: Why this job no longer holds the lease (another job took it); None while it does.
        self.lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def read(self) -> Holder | None:
        """The lease's holder, or None where there is no lease (or not one of ours to read)."""
        try:
            with self.fs.open(self.path, "r") as f:
                return Holder(**json.load(f))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # half of a lease, or not one of ours: nobody's
            return None

    def take(self, holder: Holder) -> None:
        """Makes this job the lease's holder and starts renewing it, or raises the one-line
        :class:`CheckpointError` that names the live job holding it."""
        current = self.read()
        if current is not None and current.job != holder.job:
            self._wait_for_lapse(current)
        self._write(holder)
        self.sleep(min(1.0, self.period / 2))  # a job taking the lease at the same moment writes meanwhile
        now = self.read()
        if now is None or now.token != holder.token:
            raise self._refusal(now or holder)
        self.holder = holder
        self._renewer = threading.Thread(target=self._renew, name="checkpoint-lease", daemon=True)
        self._renewer.start()
        _HELD.add(self)

    def _wait_for_lapse(self, holder: Holder) -> None:
        """Watches another job's lease until it lapses (returns) or is renewed (raises the
        refusal); a lease deleted meanwhile (its job ended) is free at once."""
        age = time.time() - holder.renewed  # by two hosts' clocks: it may only shorten the watch
        watch = min(self.lapse, max(2 * self.period, self.lapse - age))
        logger.warning(
            "--checkpoint_dir %s is held by %s: watching its lease for up to %.0f s (refused if that "
            "job renews it, taken over once it lapses)",
            self.url,
            holder.describe(),
            watch,
        )
        deadline = self.clock() + watch
        while self.clock() < deadline:
            self.sleep(min(self.period / 2, max(0.0, deadline - self.clock())))
            now = self.read()
            if now is None:
                return
            if now != holder:
                raise self._refusal(now)
        logger.warning("--checkpoint_dir %s: took over the lapsed lease of %s", self.url, holder.describe())

    def _refusal(self, holder: Holder) -> CheckpointError:
        return CheckpointError(
            f"--checkpoint_dir {self.url} is in use by {holder.describe()}, which is running: two jobs "
            "writing one folder overwrite each other's checkpoints. Wait for that job to end, or give "
            f"this one another --checkpoint_dir (if that job is gone, its {LEASE_FILE} file lapses "
            f"{self.lapse:.0f} s after its last renewal)"
        )

    def _write(self, holder: Holder) -> None:
        with self.fs.open(self.path, "w") as f:
            json.dump(asdict(holder), f)

    def _renew(self) -> None:
        """The renewal thread: every period, checks the lease is still this job's and renews it."""
        while not self._stop.wait(self.period):
            assert self.holder is not None
            try:
                current = self.read()
                if current is None or current.token != self.holder.token:
                    self.lost = f"{(current or self.holder).describe()} holds it now" if current else "it was deleted"
                    logger.error("--checkpoint_dir %s: this job lost its lease (%s)", self.url, self.lost)
                    return
                self.holder = Holder(**{**asdict(self.holder), "renewed": time.time()})
                self._write(self.holder)
            except OSError as e:  # the store for a moment unreachable: the lease lapses only after LAPSE_S
                logger.warning("--checkpoint_dir %s: could not renew the lease (%s); trying again", self.url, e)

    def check_held(self) -> None:
        """Raises :class:`CheckpointError` where another job took the lease: this one must not save."""
        if self.lost:
            raise CheckpointError(
                f"--checkpoint_dir {self.url}: this job's lease on the folder was taken ({self.lost}), so "
                "it stops without saving over that job's checkpoints. Give each job its own --checkpoint_dir"
            )

    def release(self) -> None:
        """Stops renewing and deletes the lease if it is still this job's: the folder is free at once."""
        self._stop.set()
        _HELD.discard(self)
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self.holder is None or self.lost:
            return
        current = self.read()
        if current is not None and current.token == self.holder.token:
            try:
                self.fs.rm(self.path)
            except OSError as e:
                logger.warning("--checkpoint_dir %s: could not delete its lease (%s): it lapses", self.url, e)
        self.holder = None


def release_held() -> None:
    """Gives up every lease this process still holds (:meth:`Lease.release`): a job's last act."""
    for lease in list(_HELD):
        lease.release()
