"""Sharded, atomic checkpoints at any fsspec URL, and the choice of the one to resume from.

Layout under ``--checkpoint_dir`` (a local path, ``file://``, ``s3://``, ``gs://``, ``memory://``)::

    step_00001200/
        OWNER                              the id of the run writing it, written first
        __0_0.distcp, __1_0.distcp, ...   each rank's own shards (torch.distributed.checkpoint)
        .metadata                          where every tensor's shards are, written once all ranks wrote
        manifest.json                      config, package versions, world size, sharding plan, run id
        COMMITTED                          written last: only now does the checkpoint count

Embedding tables are never gathered: every rank writes and reads only its own shards, and
``torch.distributed.checkpoint`` reshards them when the world size or sharding changes; the
optimizer states that another sharding lays out otherwise are converted (:mod:`apps.dlrm.reshard`). A
directory without ``COMMITTED``, or whose files do not match its ``.metadata``, is skipped with a
warning and never resumed from. Old checkpoints are deleted only after a newer one is committed,
and only the run's own (see :meth:`CheckpointStore._prune`).

Nothing in a checkpoint runs code: the shards are read by :mod:`apps.dlrm.checkpoint_storage`,
which runs nothing from them, and the manifest is JSON.
"""

import datetime
import importlib.metadata
import json
import logging
import os
import posixpath
import re
import socket
import time
import uuid
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.checkpoint_storage import (
    CheckpointError,
    CheckpointReader,
    HostStager,
    load_shards,
    save_shards,
    save_shards_async,
)
from apps.dlrm.common.distributed import DistEnv, decided_by_main
from apps.dlrm.config import TrainConfig
from apps.dlrm.optim import make_lazy_state
from apps.dlrm.reshard import Resharding, below
from apps.dlrm.urls import config_record

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
OWNER = "OWNER"
#: How long a background save may wait for the other ranks' writes before it fails.
SAVE_TIMEOUT_S = 1800
#: Seconds a save may wait for the one before it before the run warns that saves come too often.
LONG_WAIT_S = 1.0
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


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
    """

    def __init__(self, url: str, keep_last: int) -> None:
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.run_id: str | None = None

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
            self._make_dir(self.root)
            with self.fs.open(probe, "wb") as f:
                f.write(b"probe")
            self.fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - every failure here means the same: unusable
            raise CheckpointError(
                f"--checkpoint_dir {self.url} is not writable ({type(e).__name__}: {e}). " + _storage_hint(self.url, e)
            ) from None

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
            problem = self._problem(step)
            if problem:
                logger.warning("skipping checkpoint %s: %s", self.step_url(step), problem)
                continue
            with self.fs.open(posixpath.join(self._path(step), MANIFEST), "r") as f:
                return Checkpoint(self.step_url(step), step, json.load(f))
        return None

    def _problem(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` cannot be resumed from, or None."""
        if not self._is_committed(step):
            return "not committed (its writer stopped before every rank had finished)"
        path = self._path(step)
        try:
            with self.fs.open(posixpath.join(path, MANIFEST), "r") as f:
                json.load(f)
            metadata = CheckpointReader(self.step_url(step)).read_metadata()
        except CheckpointError:
            raise  # planted, not damaged: refuse the location rather than resume past it
        except Exception as e:  # noqa: BLE001 - unreadable for any reason: damaged
            return f"damaged ({type(e).__name__}: {e})"
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for name, size in needed.items():
            file = posixpath.join(path, name)
            if not self.fs.exists(file) or self.fs.size(file) < size:
                return f"damaged (shard file {name} is missing or truncated)"
        return None

    # --- writing -----------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], manifest: dict[str, Any], env: DistEnv) -> str:
        """Collective: every rank writes its shards; rank 0 commits and prunes. Returns the URL."""
        url = self.step_url(step)
        decided_by_main(lambda: self._claim(step), env)  # also keeps every rank out until then
        save_shards(state, url, self.is_local)  # returns on every rank once .metadata is written
        if env.is_main:
            self._commit(step, manifest)
        return url

    def save_async(
        self,
        step: int,
        state: dict[str, Any],
        manifest: dict[str, Any],
        env: DistEnv,
        group: dist.ProcessGroup,
        stager: HostStager,
    ) -> ConcurrentFuture:
        """Collective: like :meth:`save`, but returns once this rank's shards are copied to host
        memory. The future gives the URL once every rank's shards and ``.metadata`` are written
        and, on rank 0, the checkpoint is committed (or raises what went wrong)."""
        url = self.step_url(step)
        decided_by_main(lambda: self._claim(step), env)
        written = save_shards_async(state, url, self.is_local, group, stager)
        committed: ConcurrentFuture = ConcurrentFuture()

        def commit(done: ConcurrentFuture) -> None:  # in DCP's writer thread
            try:
                done.result()
                if env.is_main:
                    self._commit(step, manifest)
                committed.set_result(url)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; re-raised by result()
                committed.set_exception(e)

        written.add_done_callback(commit)
        return committed

    def _commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Rank 0, once every rank's shards are written: the manifest, then the commit marker
        (only now does the checkpoint count), then older checkpoints go."""
        with self.fs.open(posixpath.join(self._path(step), MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        with self.fs.open(posixpath.join(self._path(step), COMMIT_MARKER), "w") as f:
            f.write(json.dumps({"step": step, "time": time.time()}) + "\n")
        logger.info("step %d: checkpoint committed at %s", step, self.step_url(step))
        self._prune(newest=step)

    def _claim(self, step: int) -> None:
        """Makes ``step``'s folder this run's, before any shard is written, or refuses.

        A folder already there that this run wrote is a leftover of an attempt that died
        while writing it (or was skipped as damaged): replaced. Another run's is never touched.
        """
        assert self.run_id, "open_checkpoints sets the run id before any save"
        path = self._path(step)
        if self.fs.exists(path):
            self._refuse_if_not_ours(step)
            self.fs.rm(path, recursive=True)
        self._make_dir(path)
        with self.fs.open(posixpath.join(path, OWNER), "w") as f:
            f.write(self.run_id)

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

    def _prune(self, newest: int) -> None:
        """Deletes this run's committed checkpoints beyond ``keep_last`` and its uncommitted
        folders older than ``newest`` (attempts that died while writing them).

        Folders of other runs sharing the location (their OWNER says so, or they have none: a
        folder being written by a job of an older version) are neither counted nor deleted.
        """
        ours = [step for step in self._steps() if self._owner(step) == self.run_id]
        keep = set([step for step in ours if self._is_committed(step)][-self.keep_last :])
        for step in ours:
            if step < newest and step not in keep:
                self.fs.rm(self._path(step), recursive=True)
                logger.info("deleted old checkpoint %s", self.step_url(step))

    def load(self, checkpoint: Checkpoint, state: dict[str, Any]) -> None:
        """Collective: every rank reads the shards it holds under its current sharding."""
        load_shards(state, checkpoint.url, self.is_local)


def _storage_hint(url: str, error: Exception) -> str:
    name = type(error).__name__
    if url.startswith("s3://"):
        if "Credentials" in name or "credentials" in str(error):
            return (
                "Set AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), "
                "and AWS_ENDPOINT_URL for an S3-compatible server."
            )
        if isinstance(error, FileNotFoundError) or "NoSuchBucket" in str(error):
            return f"Create the bucket {url[5:].split('/', 1)[0]!r} first, or fix its name."
        if isinstance(error, PermissionError):
            return "Grant these credentials write access to the bucket, or choose another one."
    if isinstance(error, PermissionError):
        return "Choose a directory this user can write to."
    return "Check the URL and the storage's credentials (see README: Checkpoints)."


# --- what a checkpoint is for ------------------------------------------------------------------


def model_signature(cfg: TrainConfig) -> dict[str, Any]:
    """The options that fix the shapes of the saved tensors (and of the optimizer states)."""
    signature = {
        "num_dense_features": cfg.model.num_dense_features,
        "table_sizes": cfg.model.table_sizes,
        "embedding_dim": cfg.model.embedding_dim,
        "dense_arch_layer_sizes": cfg.model.dense_arch_layer_sizes,
        "over_arch_layer_sizes": cfg.model.over_arch_layer_sizes,
        "interaction_type": cfg.model.interaction_type,
        "embedding_optimizer": cfg.training.embedding_optimizer,
        "dense_optimizer": cfg.training.dense_optimizer,
    }
    if cfg.model.interaction_type == "dcn":
        signature.update(dcn_num_layers=cfg.model.dcn_num_layers, dcn_low_rank_dim=cfg.model.dcn_low_rank_dim)
    if cfg.model.interaction_type == "projection":
        signature.update(
            interaction_branch1_layer_sizes=cfg.model.interaction_branch1_layer_sizes,
            interaction_branch2_layer_sizes=cfg.model.interaction_branch2_layer_sizes,
        )
    return signature


def package_versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchx-nightly"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def check_compatible(checkpoint: Checkpoint, cfg: TrainConfig) -> None:
    """Refuses, before any step, a checkpoint of another model. Any sharding and world size may
    resume it: :mod:`apps.dlrm.reshard` carries the optimizer state across."""
    saved = checkpoint.manifest.get("model", {})
    wanted = model_signature(cfg)
    differences = [
        f"{name}: {_signature_value(saved.get(name))} there, {_signature_value(value)} here"
        for name, value in wanted.items()
        if saved.get(name) != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {checkpoint.url} was written for another model ("
            + "; ".join(differences)
            + "). Resume with the options it was written with, or use a new --checkpoint_dir."
        )


def _describe_resharding(checkpoint: Checkpoint, plan: dict[str, dict[str, Any]], converted: dict[str, bool]) -> str:
    """What a resume under another sharding did to the optimizer state: per change of sharding
    type, the tables whose state was converted exactly, and those that got an estimate."""
    saved_plan = checkpoint.manifest.get("sharding_plan", {})
    changes: dict[tuple[str | None, str | None, bool], list[str]] = {}  # a type is None where a plan lacks the table
    for table, exact in converted.items():
        change = (saved_plan.get(table, {}).get("type"), plan.get(table, {}).get("type"), exact)
        changes.setdefault(change, []).append(table)
    return "optimizer state converted from the checkpoint's sharding (README: Checkpoints and resuming):\n" + "\n".join(
        f"  {before} -> {after}: {'exact' if exact else 'estimated'} for {', '.join(tables)}"
        for (before, after, exact), tables in changes.items()
    )


def _signature_value(value: Any) -> str:
    """A model signature's value for people: a list of one repeated size as COUNTxSIZE (26x2000)."""
    if isinstance(value, list):
        if value and all(v == value[0] for v in value) and len(value) > 3:
            return f"{len(value)}x{value[0]}"
        return ",".join(str(v) for v in value)
    return str(value)


# --- the training run's checkpoints -------------------------------------------------------------


@dataclass
class CheckpointFolder:
    """``--checkpoint_dir`` opened: its store (None without one) and the checkpoint to resume from."""

    store: CheckpointStore | None
    resume_from: Checkpoint | None


def open_checkpoints(cfg: TrainConfig, env: DistEnv) -> CheckpointFolder:
    """Collective. The store of ``--checkpoint_dir`` and the checkpoint to resume from (if any).

    Rank 0 checks that the location is writable and picks the newest committed checkpoint;
    every rank gets the same answer or raises the same error, before any training step.
    """
    if not cfg.checkpoint.checkpoint_dir:
        return CheckpointFolder(None, None)
    if cfg.checkpoint.checkpoint_dir.startswith("memory://") and env.world_size > 1:
        raise CheckpointError(
            f"--checkpoint_dir {cfg.checkpoint.checkpoint_dir}: memory:// lives inside one process, so "
            f"{env.world_size} ranks cannot share it; use a directory or an s3:// / gs:// URL"
        )
    store = CheckpointStore(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.keep_last)

    def newest() -> tuple[Checkpoint | None, str]:
        store.check_writable()
        checkpoint = store.newest()
        inherited = checkpoint.manifest.get("run_id") if checkpoint else None
        store.run_id = inherited or _new_run_id()
        resumed_at = checkpoint.step if checkpoint else 0
        store.check_claimable(lambda step: is_checkpoint_step(cfg, step), after=resumed_at)
        return checkpoint, store.run_id

    resume_from, store.run_id = decided_by_main(newest, env)
    check_shared(store, env)
    return CheckpointFolder(store, resume_from)


def is_checkpoint_step(cfg: TrainConfig, step: int) -> bool:
    """Whether training saves a checkpoint after ``step`` (every --checkpoint_every, and the last)."""
    return step == cfg.training.steps or bool(
        cfg.checkpoint.checkpoint_every and step % cfg.checkpoint.checkpoint_every == 0
    )


def _new_run_id() -> str:
    """The id of a run that resumes from nothing (a resumed run keeps its checkpoint's).

    torchrun's rendezvous id where one was given (TorchX gives the app id): a job restarted
    before its first commit then still owns the folder its first attempt left. Else random.
    """
    rendezvous = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # "none": torchrun's default
    return rendezvous if rendezvous != "none" else uuid.uuid4().hex


def check_shared(store: CheckpointStore, env: DistEnv) -> None:
    """Collective. Refuses a location the job's hosts do not all see as one and the same.

    A local folder on each host (or an S3 endpoint of each host's own) would let every host
    write its own ranks' shards where no other host sees them: the checkpoint would never be
    complete anywhere, and every restart would begin from step 0. Rank 0 writes a probe and every
    rank must read it back, before any step.
    """
    if env.num_nodes < 2:
        return
    probe = decided_by_main(store.write_share_probe, env)
    seen = store.reads_share_probe(*probe)
    views: list[Any] = [None] * env.world_size
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if env.is_main:
        store.fs.rm(probe[0])
    blind = sorted({host for ok, host in views if not ok})
    if blind:
        raise CheckpointError(
            f"--checkpoint_dir {store.url} is not shared by every host of the job: "
            f"{', '.join(blind)} cannot read what rank 0 wrote there, so no checkpoint could ever be "
            "complete. Use a folder that every host mounts (NFS, FSx, EFS, ...) or an object store "
            "URL (s3://, gs://) that every host reaches"
        )


@dataclass
class TrainState:
    """Where a run is: the last finished step, its training loss, and this rank's RNG stream.

    A checkpoint saves it beside the model and optimizer and a resumed run continues from it:
    its :meth:`state_dict` entries are top-level tensors of the checkpoint (DCP mistakes a nested
    dict of plain numbers for its pre-2.4 format when each rank holds other optimizer states).
    """

    rank: int
    step: int = 0
    train_loss: float = float("nan")

    @property
    def _rng_key(self) -> str:
        return f"rng_rank{self.rank}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "progress": torch.tensor([float(self.step), self.train_loss], dtype=torch.float64),
            self._rng_key: torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Takes the step and loss, and the RNG stream where ``state`` has this rank's."""
        step, self.train_loss = state["progress"].tolist()
        self.step = int(step)
        if self._rng_key in state:
            torch.set_rng_state(state[self._rng_key])

    def progress(self) -> dict[str, Any]:
        """The JSON form, for the manifest."""
        return {"step": self.step, "train_loss": self.train_loss}


@dataclass
class Checkpointed:
    """What a checkpoint holds beside the run's :class:`TrainState`: the sharded model, its
    optimizers, and the plan they are sharded by (per table, as
    :func:`apps.dlrm.sharding.plan_tables` gives it; written into the manifest)."""

    model: nn.Module
    optimizer: CombinedOptimizer
    plan: dict[str, dict[str, Any]]


class Checkpointer:
    """The checkpoints of one training run, built once with what they hold (collective).

    Given ``--checkpoint_dir`` already opened (:func:`open_checkpoints`, which runs before the
    model is built, so that a bad location fails in seconds) and what to save, it says which
    steps save,
    saves (in the background with --checkpoint_async: the state is copied to host memory, then
    written while training goes on) and commits, restores, and has the store prune. At most one
    save is in flight: the next one, and :meth:`close`, wait for it. A save commits (its
    ``COMMITTED`` marker is written by rank 0) only once every rank's shards and DCP's
    ``.metadata`` are written, so a run that dies mid-save leaves nothing that counts.
    """

    def __init__(self, cfg: TrainConfig, env: DistEnv, folder: CheckpointFolder, checkpointed: Checkpointed) -> None:
        self.cfg, self.env = cfg, env
        self.store, self.resume_from = folder.store, folder.resume_from
        self.checkpointed = checkpointed
        self.stalls: list[float] = []  # seconds each save blocked the training loop
        self.waits: list[float] = []  # of which waiting for the save before it to be written
        self._in_flight: ConcurrentFuture | None = None
        # Async saves coordinate over a gloo group of their own: their collectives run in DCP's
        # writer thread while training's run on the default group.
        self._async: tuple[dist.ProcessGroup, HostStager] | None = None
        if self.store is not None and cfg.checkpoint.checkpoint_async:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SAVE_TIMEOUT_S))
            self._async = group, HostStager(pinned=env.device.type == "cuda")

    def due(self, step: int) -> bool:
        """Whether a checkpoint is saved after ``step``."""
        return self.store is not None and is_checkpoint_step(self.cfg, step)

    def restore(self, state: TrainState, checkpoint: Checkpoint | None = None) -> Checkpoint | None:
        """Collective. Loads ``checkpoint`` (by default the one to resume from, if any) into the
        model, optimizers and ``state``; returns it. It may have been written under any sharding
        and world size: optimizer states whose layout differs are converted (:mod:`apps.dlrm.reshard`)."""
        checkpoint = checkpoint or self.resume_from
        if checkpoint is None:
            return None
        check_compatible(checkpoint, self.cfg)
        loaded = TrainState(self.env.rank, checkpoint.manifest["progress"]["step"])
        entries = self.entries(loaded)
        if checkpoint.manifest["world_size"] != self.env.world_size:
            del entries[loaded._rng_key]  # other ranks, other streams: keep this process's own
        optimizer = entries["optimizer"]
        make_lazy_state(optimizer)
        optimizer_state = optimizer.state_dict()
        saved = CheckpointReader(checkpoint.url).read_metadata()
        resharding = Resharding(
            optimizer_state,
            below(saved, "optimizer"),
            entries["model"],
            below(saved, "model"),
            self.cfg.training.embedding_optimizer,
            loaded.step,
        )
        self._store().load(checkpoint, {**entries, "optimizer": resharding.destinations})
        resharding.apply()
        optimizer.load_state_dict(optimizer_state)
        state.load_state_dict(entries)
        if self.env.is_main and resharding.converted:
            logger.info("%s", _describe_resharding(checkpoint, self.checkpointed.plan, resharding.converted))
        return checkpoint

    def save(self, state: TrainState) -> str:
        """Collective. Saves the checkpoint of ``state.step``; returns its URL. Synchronous, or
        with --checkpoint_async returns once the state is copied to host memory (after the save
        before it, if still in flight, is committed); it commits once written."""
        start = time.perf_counter()
        self.wait()
        self.waits.append(time.perf_counter() - start)
        self._warn_if_waited(state.step)
        entries, manifest, store = self.entries(state), self._manifest(state), self._store()
        if self._async is None:
            store.save(state.step, entries, manifest, self.env)
        else:
            group, stager = self._async
            self._in_flight = store.save_async(state.step, entries, manifest, self.env, group, stager)
        self.stalls.append(time.perf_counter() - start)
        return store.step_url(state.step)

    def _warn_if_waited(self, step: int) -> None:
        if self.env.is_main and self.waits[-1] > LONG_WAIT_S:
            logger.warning(
                "step %d: the checkpoint waited %.1f s for the one before it, still being written: a "
                "save takes longer than --checkpoint_every %d steps of training; raise it so that "
                "training does not wait",
                step,
                self.waits[-1],
                self.cfg.checkpoint.checkpoint_every,
            )

    def wait(self) -> None:
        """Waits for the save in flight to be written and committed; raises its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Waits for the save in flight: call it before the process group goes."""
        self.wait()
        if self._async is not None:
            group, stager = self._async
            stager.close()
            dist.destroy_process_group(group)
            self._async = None

    def entries(self, state: TrainState) -> dict[str, Any]:
        """What a checkpoint holds: DCP calls ``state_dict``/``load_state_dict`` on the
        stateful parts. Tables and fused optimizer states are sharded tensors, each rank saving
        and loading its own shards; the model's state dict holds views of its weights, so DCP
        loads into them in place (no second copy through ``load_state_dict``)."""
        parts = self.checkpointed
        return {"model": parts.model.state_dict(), "optimizer": parts.optimizer, **state.state_dict()}

    def _manifest(self, state: TrainState) -> dict[str, Any]:
        return {
            "step": state.step,
            "world_size": self.env.world_size,
            "progress": state.progress(),
            "model": model_signature(self.cfg),
            "sharding_plan": self.checkpointed.plan,
            "config": config_record(self.cfg),
            "versions": package_versions(),
            "run_id": self._store().run_id,
        }

    def _store(self) -> CheckpointStore:
        """The store of --checkpoint_dir, for a save or an explicit restore, which need one."""
        assert self.store is not None, "a run without --checkpoint_dir neither saves nor restores"
        return self.store
