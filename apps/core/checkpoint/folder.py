"""Sharded, atomic checkpoints at any fsspec URL, and the choice of the one to resume from.

Layout under ``--checkpoint_dir`` (a local path, ``file://``, ``s3://``, ``gs://``, ``memory://``)::

    step_00001200/
        OWNER                              the id of the run writing it, written first
        __0_0.distcp, __1_0.distcp, ...   each rank's own shards (torch.distributed.checkpoint)
        __0_1.distcp                       the entries every rank holds, written by rank 0
        .metadata                          where every tensor's shards are, written once all ranks wrote
        manifest.json                      config, package versions, world size, sharding plan, run id,
                                           the checksums of the shard files
        COMMITTED                          written last: only now does the checkpoint count

Embedding tables are never gathered: every rank writes and reads only its own shards, and
``torch.distributed.checkpoint`` reshards them when the world size or sharding changes; the
optimizer states that another sharding lays out otherwise are converted (:mod:`apps.core.checkpoint.reshard`). A
directory without ``COMMITTED``, or whose files do not match its ``.metadata`` and checksums, is
skipped with a warning and never resumed from (a load that finds a block damaged falls back to
the checkpoint before it, :class:`apps.core.checkpoint.checkpointer.Checkpointer`). Old
checkpoints are deleted only after a newer one is committed, only the run's own, and never the
newest one that a load verified (see :meth:`CheckpointStore._prune`).

Nothing in a checkpoint runs code: the shards are read by :mod:`apps.core.checkpoint.storage`,
which runs nothing from them, and the manifest is JSON.
"""

import contextlib
import json
import logging
import posixpath
import re
import time
import uuid
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import fsspec
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.metadata import Metadata

from apps.core.checkpoint.lease import LEASE_FILE, Holder, Lease
from apps.core.checkpoint.storage.checksums import Checksums
from apps.core.checkpoint.storage.errors import CheckpointError, DamagedCheckpoint, SaveFailed, no_space_left
from apps.core.checkpoint.storage.loading import load_shards
from apps.core.checkpoint.storage.reader import CheckpointReader
from apps.core.checkpoint.storage.saving import HostStager, save_shards, save_shards_async
from apps.core.common.distributed import DistEnv, decided_by_main
from apps.core.common.errors import ConfigError
from apps.core.urls import is_url, reaching

logger = logging.getLogger(__name__)


COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
OWNER = "OWNER"
#: The manifest's record of the shard files' checksums (:class:`Checksums`).
CHECKSUMS = "checksums"
#: At the root: which checkpoint holds the best validation (JSON: its step and metrics).
BEST_MARKER = "BEST"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_checkpoint_entry(name: str) -> bool:
    """Whether ``name`` is one a checkpoint folder holds at its top: a step's folder, the run's
    OWNER, the BEST marker, the live job's LEASE (a run folder that is also the checkpoint folder
    holds them as its own)."""
    return _step_of(name) is not None or name in (OWNER, BEST_MARKER, LEASE_FILE)


def _step_of(name: str) -> int | None:
    """The step of a folder named exactly as we name them, else None: a foreign
    ``step_000000002`` is not step 2 (whose folder is ``step_00000002``)."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match and name == _step_name(int(match.group(1))) else None


@dataclass(frozen=True)
class Checkpoint:
    url: str
    step: int
    manifest: dict[str, Any]


class CheckpointStore:
    """The checkpoints under one URL. Reads and deletions are done by one rank (rank 0).

    ``run_id`` names the run that writes here: :func:`open_checkpoints` sets it, the same on
    every rank, before the first save. Each step folder records the run that wrote it, and a
    run deletes only its own folders: jobs sharing the location leave each other's alone.
    ``damaged`` has the checkpoints a load found damaged, and why (skipped from then on);
    ``verified`` is the newest step a load checked against its checksums.
    """

    def __init__(self, url: str, keep_last: int) -> None:
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.run_id: str | None = None
        self.damaged: dict[int, str] = {}
        self.verified: int | None = None
        #: Rank 0's lease on the folder, while a job that trains holds it (:meth:`hold`).
        self.lease: Lease | None = None

    @property
    def is_local(self) -> bool:
        """Whether the checkpoints are files of this machine's file systems (not an object store)."""
        return isinstance(self.fs, LocalFileSystem)

    def step_url(self, step: int) -> str:
        return f"{self.url}/{_step_name(step)}"

    def _path(self, step: int) -> str:
        return posixpath.join(self.root, _step_name(step))

    # --- start-up checks ---------------------------------------------------------------------

    def check_writable(self) -> None:
        """Writes and removes a probe file, so that a bad location fails before training."""
        probe = posixpath.join(self.root, f".write-probe-{uuid.uuid4().hex}")
        try:
            with reaching("--checkpoint_dir", self.url):
                self._make_dir(self.root)
                with self.fs.open(probe, "wb") as f:
                    f.write(b"probe")
                self.fs.rm(probe)
        except ConfigError:
            raise  # the store cannot be reached at all: reaching's message says how to fix that
        except Exception as e:  # noqa: BLE001 - every other failure here means the same: unusable
            raise CheckpointError(
                f"--checkpoint_dir {self.url} is not writable ({type(e).__name__}: {e}). " + _storage_hint(self.url, e)
            ) from None

    def hold(self) -> None:
        """Rank 0 of a job that will save here: takes the folder's lease (:mod:`apps.core.checkpoint.lease`)
        before reading any checkpoint, or refuses the folder that another live job holds."""
        self.lease = Lease(self.fs, self.root, self.url)
        self.lease.take(Holder.of_this_process())

    def release(self) -> None:
        """Gives up the lease, if this process holds it (a job's end)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _check_held(self) -> None:
        if self.lease is not None:
            self.lease.check_held()

    def _make_dir(self, path: str) -> None:
        """Makes the folder ``path`` where folders are real: on object stores makedirs would
        create the bucket, and a missing bucket must be reported, not silently created."""
        if self.is_local:
            self.fs.makedirs(path, exist_ok=True)

    def write_share_probe(self) -> tuple[str, str]:
        """Writes a probe file with a random token; returns (its path, the token)."""
        token = uuid.uuid4().hex
        path = posixpath.join(self.root, f".share-probe-{token}")
        with self.fs.open(path, "w") as f:
            f.write(token)
        return path, token

    def reads_share_probe(self, path: str, token: str) -> bool:
        """Whether this process sees the probe another rank wrote."""
        try:
            with self.fs.open(path, "r") as f:
                return f.read() == token
        except OSError:
            return False

    # --- listing -----------------------------------------------------------------------------

    def _steps(self) -> list[int]:
        """The step of every step_* directory, committed or not."""
        if not self.fs.exists(self.root):
            return []
        names = (posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))
        return sorted(step for step in map(_step_of, names) if step is not None)

    def _is_committed(self, step: int) -> bool:
        return self.fs.exists(posixpath.join(self._path(step), COMMIT_MARKER))

    def _owner(self, step: int) -> str | None:
        """The id of the run that wrote ``step``'s folder; None where it does not say."""
        try:
            with self.fs.open(posixpath.join(self._path(step), OWNER), "r") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def newest(self) -> Checkpoint | None:
        """The newest committed checkpoint whose files are all there; others are skipped."""
        for step in reversed(self._steps()):
            checkpoint = self.at(step)
            if checkpoint is not None:
                return checkpoint
        return None

    def best(self) -> Checkpoint | None:
        """The checkpoint the BEST marker names, if there is one and it can be read."""
        try:
            with self.fs.open(posixpath.join(self.root, BEST_MARKER), "r") as f:
                step = int(json.load(f)["step"])
        except FileNotFoundError:
            return None
        return self.at(step)

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first (for messages)."""
        return [step for step in self._steps() if self._is_committed(step)]

    def at(self, step: int) -> Checkpoint | None:
        """The committed checkpoint of ``step`` if its files are all there (else None, warning why)."""
        problem = self._problem(step)
        if problem:
            logger.warning("skipping checkpoint %s: %s", self.step_url(step), problem)
            return None
        with self.fs.open(posixpath.join(self._path(step), MANIFEST), "r") as f:
            return Checkpoint(self.step_url(step), step, json.load(f))

    def _problem(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` cannot be resumed from, or None."""
        if step in self.damaged:
            return f"damaged ({self.damaged[step]})"
        if not self._is_committed(step):
            return "not committed (its writer stopped before every rank had finished)"
        try:
            with self.fs.open(posixpath.join(self._path(step), MANIFEST), "r") as f:
                checksums = Checksums.of(json.load(f).get(CHECKSUMS))
            metadata = CheckpointReader(self.step_url(step)).read_metadata()
            self._check_sizes(step, metadata, checksums)
        except DamagedCheckpoint as e:
            return f"damaged ({e})"
        except CheckpointError:
            raise  # planted, not damaged: refuse the location rather than resume past it
        except Exception as e:  # noqa: BLE001 - unreadable for any reason: damaged
            return f"damaged ({type(e).__name__}: {e})"
        return None

    def _check_sizes(self, step: int, metadata: Metadata, checksums: Checksums | None) -> None:
        """Raises :class:`DamagedCheckpoint` unless every shard file that ``metadata`` names is
        there, holding its entries, and as large as it was written (where ``checksums`` say)."""
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in needed.items():
            file = posixpath.join(self._path(step), name)
            found = self.fs.size(file) if self.fs.exists(file) else -1
            if found < size:
                raise DamagedCheckpoint(f"shard file {name} is missing or truncated")
            if checksums is not None and found != (written := checksums.of_file(name).size):
                raise DamagedCheckpoint(f"shard file {name} is {found} bytes, not the {written} written")

    # --- writing -----------------------------------------------------------------------------

    def save(
        self, step: int, state: dict[str, Any], manifest: dict[str, Any], env: DistEnv, best_step: int | None = None
    ) -> str:
        """Collective: every rank writes its shards; rank 0 commits and prunes (never ``best_step``,
        the checkpoint of the run's best validation). Returns the URL."""
        url = self.step_url(step)
        decided_by_main(lambda: self._claim(step), env)  # also keeps every rank out until then
        checksums = save_shards(state, url, self.is_local)  # returns on every rank once .metadata is written
        if env.is_main:
            self._commit(step, manifest, best_step, checksums)
        return url

    def save_async(
        self,
        step: int,
        state: dict[str, Any],
        manifest: dict[str, Any],
        env: DistEnv,
        group: dist.ProcessGroup,
        stager: HostStager,
        best_step: int | None = None,
    ) -> ConcurrentFuture:
        """Collective: like :meth:`save`, but returns once this rank's shards are copied to host
        memory. The future gives the URL once every rank's shards and ``.metadata`` are written
        and, on rank 0, the checkpoint is committed (or raises what went wrong)."""
        url = self.step_url(step)
        decided_by_main(lambda: self._claim(step), env)

        def commit(checksums: Checksums | None) -> str:  # in DCP's writer thread
            if env.is_main:
                self._commit(step, manifest, best_step, checksums)
            return url

        return save_shards_async(state, url, self.is_local, group, stager, then=commit)

    def _commit(self, step: int, manifest: dict[str, Any], best_step: int | None, checksums: Checksums | None) -> None:
        """Rank 0, once every rank's shards are written: the manifest with the shards'
        ``checksums``, then the commit marker (only now does the checkpoint count), the BEST marker
        if it is the best, then older checkpoints go (the best one stays)."""
        assert checksums is not None, "rank 0's writer has every rank's checksums"
        self._check_held()
        with self._space_for(step, "its manifest"):
            with self.fs.open(posixpath.join(self._path(step), MANIFEST), "w") as f:
                json.dump({**manifest, CHECKSUMS: checksums.record()}, f, indent=2, sort_keys=True)
            with self.fs.open(posixpath.join(self._path(step), COMMIT_MARKER), "w") as f:
                f.write(json.dumps({"step": step, "time": time.time()}) + "\n")
        logger.info("step %d: checkpoint committed at %s", step, self.step_url(step))
        if best_step == step:
            with self.fs.open(posixpath.join(self.root, BEST_MARKER), "w") as f:
                f.write(json.dumps({"step": step, "url": self.step_url(step), "run_id": self.run_id}) + "\n")
        self._prune(newest=step, best_step=best_step)

    def _claim(self, step: int) -> None:
        """Makes ``step``'s folder this run's, before any shard is written, or refuses.

        A folder already there that this run wrote is a leftover of an attempt that died
        while writing it (or was skipped as damaged): replaced. Another run's is never touched.
        """
        assert self.run_id, "open_checkpoints sets the run id before any save"
        self._check_held()
        path = self._path(step)
        if self.fs.exists(path):
            self._refuse_if_not_ours(step)
            self.fs.rm(path, recursive=True)
            self.damaged.pop(step, None)
        with self._space_for(step, "its folder"):
            self._make_dir(path)
            with self.fs.open(posixpath.join(path, OWNER), "w") as f:
                f.write(self.run_id)

    @contextlib.contextmanager
    def _space_for(self, step: int, what: str) -> Iterator[None]:
        """The block's writes for step ``step``'s checkpoint; a full disk (or quota) ends the run
        as a full disk during its shards' writes does (:class:`SaveFailed`, one line), the
        checkpoint uncommitted and the committed ones kept."""
        try:
            yield
        except OSError as e:
            if not no_space_left(e):
                raise
            raise SaveFailed.no_space(self.url, f" for step {step}'s checkpoint ({what})") from None

    def _refuse_if_not_ours(self, step: int) -> None:
        owner = self._owner(step)
        if owner != self.run_id:
            raise CheckpointError(
                f"{self.step_url(step)} exists already, written by "
                f"{f'run {owner}' if owner else 'an unknown writer'}, not by this run "
                f"({self.run_id}): another job writes checkpoints to --checkpoint_dir {self.url}. "
                "Give each job its own --checkpoint_dir, or delete that folder if no job writes it"
            )

    def check_claimable(self, steps: Callable[[int], bool], after: int) -> None:
        """Refuses, before training, a run that would have to save over another run's folder:
        an existing step folder past ``after`` for which ``steps(step)`` says this run saves."""
        for step in self._steps():
            if step > after and steps(step):
                self._refuse_if_not_ours(step)

    def _prune(self, newest: int, best_step: int | None = None) -> None:
        """Deletes this run's committed checkpoints beyond ``keep_last``, and its uncommitted or
        damaged folders, older than ``newest`` (attempts that died while writing them). Kept
        beside the ``keep_last`` newest: ``best_step``'s, the run's best validation, and the
        newest one a load verified (the one resumed from): until a load has verified a newer
        one, it is the last known to be good, and a damaged checkpoint is never counted as one.

        Folders of other runs sharing the location (their OWNER says so, or they have none: a
        folder being written by a job of an older version) are neither counted nor deleted.
        """
        ours = [step for step in self._steps() if self._owner(step) == self.run_id]
        good = [step for step in ours if self._is_committed(step) and step not in self.damaged]
        keep = set(good[-self.keep_last :]) | {best_step, self.verified}
        for step in ours:
            if step < newest and step not in keep:
                self.fs.rm(self._path(step), recursive=True)
                logger.info("deleted old checkpoint %s", self.step_url(step))

    def load(self, checkpoint: Checkpoint, state: dict[str, Any], metadata: Metadata | None = None) -> None:
        """Collective: every rank reads the shards it holds under its current sharding, checked
        against the checksums in its manifest; raises :class:`DamagedCheckpoint` on every rank
        where they do not match. A checkpoint of an earlier version has none: it loads unchecked.
        ``metadata``: its ``.metadata``, where this rank has read it already."""
        checksums = Checksums.of(checkpoint.manifest.get(CHECKSUMS))
        if checksums is None:
            logger.info("%s has no checksums (written before they were recorded): it loads unverified", checkpoint.url)
        load_shards(state, checkpoint.url, self.is_local, checksums, metadata)
        if checksums is not None:
            self.verified = max(self.verified or 0, checkpoint.step)


def _storage_hint(url: str, error: Exception) -> str:
    if url.startswith("s3://"):
        if isinstance(error, FileNotFoundError) or "NoSuchBucket" in str(error):
            return f"Create the bucket {url[5:].split('/', 1)[0]!r} first, or fix its name."
        if isinstance(error, PermissionError):
            return "Grant these credentials write access to the bucket, or choose another one."
    if isinstance(error, PermissionError):
        return "Choose a directory this user can write to."
    if isinstance(error, (FileExistsError, NotADirectoryError)) and not is_url(url):
        return "Give --checkpoint_dir a folder (new or one of checkpoints), not a file."
    return "Check the URL and the storage's credentials (docs/checkpoints.md)."
