"""A training run's checkpoints: :class:`Checkpointer` saves (in the background or not),
restores (under any sharding and world size) and has the folder prune; :func:`open_checkpoints`
picks the checkpoint to resume from before the model is built; :class:`TrainState` is where the
run is. What a checkpoint folder holds and how it commits is :mod:`apps.core.checkpoint.folder`.
"""

import datetime
import importlib.metadata
import logging
import os
import socket
import time
import uuid
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from apps.core.checkpoint.folder import Checkpoint, CheckpointStore
from apps.core.checkpoint.id_maps import IdMapSplit, splits
from apps.core.checkpoint.reshard import Resharding, below
from apps.core.checkpoint.storage.errors import CheckpointError, DamagedCheckpoint
from apps.core.checkpoint.storage.reader import CheckpointReader
from apps.core.checkpoint.storage.saving import HostStager
from apps.core.common.distributed import DistEnv, decided_by_main
from apps.core.common.tables import Tables
from apps.core.config import SharedSections
from apps.core.urls import config_record
from apps.core.zch.modules import settle_loaded_state

logger = logging.getLogger(__name__)

#: How long a background save may wait for the other ranks' writes before it fails.
SAVE_TIMEOUT_S = 1800
#: Seconds a save may wait for the one before it before the run warns that saves come too often.
LONG_WAIT_S = 1.0

# --- what a checkpoint is for ------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchx-nightly"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def check_compatible(checkpoint: Checkpoint, cfg: SharedSections) -> None:
    """Refuses, before any step, a checkpoint of another model (its manifest's ``model``, the
    signature of the config it was written with, differs from ``cfg``'s). Any sharding and world
    size may resume it: :mod:`apps.core.checkpoint.reshard` carries the optimizer state across."""
    saved = checkpoint.manifest.get("model", {})
    wanted = cfg.model_signature()
    # Either side's keys: an option that only some models record (--categorical_ids zch) differs
    # from its absence too.
    differences = [
        f"{name}: {_signature_value(saved.get(name))} there, {_signature_value(wanted.get(name))} here"
        for name in {**saved, **wanted}
        if saved.get(name) != wanted.get(name)
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
    return "optimizer state converted from the checkpoint's sharding (docs/checkpoints.md):\n" + "\n".join(
        f"  {before} -> {after}: {'exact' if exact else 'estimated'} for {', '.join(tables)}"
        for (before, after, exact), tables in changes.items()
    )


def _signature_value(value: Any) -> str:
    """A model signature's value for people: a list of one repeated size as COUNTxSIZE (26x2000)."""
    if value is None:
        return "not set (its default)"
    if isinstance(value, list):
        if value and all(v == value[0] for v in value) and len(value) > 3:
            return f"{len(value)}x{value[0]}"
        return ",".join(str(v) for v in value)
    return str(value)


# --- the training run's checkpoints -------------------------------------------------------------


@dataclass
class CheckpointFolder:
    """``--checkpoint_dir`` opened: its store (None without one), the checkpoint to resume from,
    and the run's id (a resumed run's is its checkpoint's), the same on every rank."""

    store: CheckpointStore | None
    resume_from: Checkpoint | None
    run_id: str


def open_checkpoints(cfg: SharedSections, env: DistEnv) -> CheckpointFolder:
    """Collective. The store of ``--checkpoint_dir``, the checkpoint to resume from (if any) and
    the run's id.

    Rank 0 checks that the location is writable, takes its lease for a job that trains (a
    folder held by another live job is refused: :mod:`apps.core.checkpoint.lease`) and picks the
    newest committed checkpoint; every rank gets the same answer or raises the same error, before
    any training step.
    """
    if not cfg.checkpoint.checkpoint_dir:
        return CheckpointFolder(None, None, decided_by_main(_new_run_id, env))
    if cfg.checkpoint.checkpoint_dir.startswith("memory://") and env.world_size > 1:
        raise CheckpointError(
            f"--checkpoint_dir {cfg.checkpoint.checkpoint_dir}: memory:// lives inside one process, so "
            f"{env.world_size} ranks cannot share it; use a directory or an s3:// / gs:// URL"
        )
    store = CheckpointStore(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.keep_last)

    def newest() -> tuple[Checkpoint | None, str]:
        store.check_writable()
        if not cfg.evaluation.evaluate_checkpoint:  # evaluating only reads: it needs no lease
            store.hold()
        checkpoint = store.newest()
        inherited = checkpoint.manifest.get("run_id") if checkpoint else None
        store.run_id = inherited or _new_run_id()
        resumed_at = checkpoint.step if checkpoint else 0
        # The run's last step is known here only when --steps gives it (else the data decides it).
        schedule = SaveSchedule(cfg.checkpoint.checkpoint_every, cfg.training.steps)
        store.check_claimable(schedule.due, after=resumed_at)
        return checkpoint, store.run_id

    resume_from, run_id = decided_by_main(newest, env)
    store.run_id = run_id
    check_shared(store, env)
    return CheckpointFolder(store, resume_from, run_id)


@dataclass(frozen=True)
class SaveSchedule:
    """Which steps a run saves a checkpoint after: every ``every`` steps (--checkpoint_every; 0:
    none between), its last step wherever that falls, and a step whose model its validations
    ask to keep (the best so far, the last before stopping early), to be tested at the end."""

    every: int
    last_step: int

    def due(self, step: int, keep: bool = False) -> bool:
        """Whether a checkpoint is saved after ``step`` (1-based); ``keep``: the validations keep its model."""
        return keep or step == self.last_step or bool(self.every and step % self.every == 0)


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


class Recorded(Protocol):
    """A part of where a run is that checkpoints keep in their manifest (JSON), not as tensors:
    the run's validations (:class:`apps.core.training.validations.Validations`, which owns them;
    checkpoint/ cannot import training/)."""

    def record(self) -> dict[str, Any]:
        """The JSON form a checkpoint's manifest keeps."""
        ...

    def resume(self, record: dict[str, Any]) -> None:
        """Takes ``record`` back, as a checkpoint's manifest kept it (empty: an older checkpoint's)."""
        ...


@dataclass
class TrainState:
    """Where a run is: the last finished step, its training loss, this rank's RNG stream, and
    its validations.

    A checkpoint saves it beside the model and optimizer and a resumed run continues from it:
    its :meth:`state_dict` entries are top-level tensors of the checkpoint (DCP mistakes a nested
    dict of plain numbers for its pre-2.4 format when each rank holds other optimizer states).
    """

    rank: int
    step: int = 0
    train_loss: float = float("nan")
    #: The run's validations so far, kept in the manifest (JSON): not a tensor, so checkpoints of
    #: earlier versions still load. None: a state that keeps none (an explicit load, a tool).
    validations: Recorded | None = None

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
        validations = self.validations.record() if self.validations is not None else {}
        return {"step": self.step, "train_loss": self.train_loss, "validations": validations}


def make_lazy_state(optimizer: CombinedOptimizer) -> None:
    """Makes the state that ``torch.optim`` optimizers create only at their first step (Adam's
    moments and step count), so that a checkpoint's state has tensors to be loaded into in place
    (DCP loads only entries the destination has: a fresh Adam would silently start from zero).

    TorchRec's ``init_state`` does it with a step on zero gradients, which moves no weight for
    our optimizers (no weight decay); the fused optimizers are left alone (their state exists).
    """
    for name, part in optimizer.optimizers:
        if name == "dense":
            part.init_state()
            part.zero_grad(set_to_none=True)


@dataclass
class Checkpointed:
    """What a checkpoint holds beside the run's :class:`TrainState`: the sharded model, its
    optimizers, the plan they are sharded by (per table, as
    :func:`apps.core.training.sharding.plan_tables` gives it; written into the manifest), and
    where the model's tables are (whose optimizer states a resume under another sharding converts);
    and the columns the model reads, as the data source resolved them (written into the manifest;
    None where the options alone fix them)."""

    model: nn.Module
    optimizer: CombinedOptimizer
    plan: dict[str, dict[str, Any]]
    tables: Tables
    columns: dict[str, Any] | None = None


class Checkpointer:
    """The checkpoints of one training run, built once with what they hold (collective).

    Given ``--checkpoint_dir`` already opened (:func:`open_checkpoints`, which runs before the
    model is built, so that a bad location fails in seconds) and what to save, it decides which
    steps save (:class:`SaveSchedule`: the training loop offers it every step), saves (in the
    background with --checkpoint_async: the state is copied to host memory, then written while
    training goes on) and commits, restores, and has the store prune. At most one
    save is in flight: the next one, and :meth:`close`, wait for it. A save commits (its
    ``COMMITTED`` marker is written by rank 0) only once every rank's shards and DCP's
    ``.metadata`` are written, so a run that dies mid-save leaves nothing that counts.
    """

    def __init__(
        self, cfg: SharedSections, env: DistEnv, folder: CheckpointFolder, checkpointed: Checkpointed, last_step: int
    ) -> None:
        self.cfg, self.env = cfg, env
        self.schedule = SaveSchedule(cfg.checkpoint.checkpoint_every, last_step)
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

    def named(self, which: str) -> Checkpoint:
        """Collective. The checkpoint ``which`` names (best, latest or a step), or a one-line
        refusal naming what the folder has."""
        store = self._store()

        def find() -> Checkpoint | None:
            return store.best() if which == "best" else store.newest() if which == "latest" else store.at(int(which))

        checkpoint = decided_by_main(find, self.env)
        if checkpoint is None:
            steps = decided_by_main(store.steps, self.env)
            have = f"committed steps: {', '.join(map(str, steps))}" if steps else "no committed checkpoint"
            best = " and no BEST marker (a run marks one when it validates)" if which == "best" else ""
            raise CheckpointError(f"--evaluate_checkpoint {which}: {store.url} has {have}{best}; name one of them")
        return checkpoint

    def committed(self, step: int) -> Checkpoint:
        """Collective. The committed checkpoint of ``step`` (after the save in flight is written)."""
        self.wait()
        checkpoint = decided_by_main(lambda: self._store().at(step), self.env)
        if checkpoint is None:
            raise CheckpointError(f"the checkpoint of step {step} in {self._store().url} cannot be read back")
        return checkpoint

    def due(self, step: int, keep: bool = False) -> bool:
        """Whether a checkpoint is saved after ``step`` (never without --checkpoint_dir); ``keep``:
        the validations ask to keep the model after it."""
        return self.store is not None and self.schedule.due(step, keep)

    def save_if_due(self, state: TrainState, keep: bool = False) -> str | None:
        """Collective. Saves the checkpoint of ``state.step`` if it is :meth:`due` (see :meth:`save`);
        returns its URL, or None where the step saves nothing."""
        return self.save(state) if self.due(state.step, keep) else None

    def restore(self, state: TrainState, checkpoint: Checkpoint | None = None) -> Checkpoint | None:
        """Collective. Loads ``checkpoint`` (by default the one to resume from, if any) into the
        model, optimizers and ``state``; returns it. It may have been written under any sharding
        and world size: optimizer states whose layout differs are converted (:mod:`apps.core.checkpoint.reshard`).

        A checkpoint to resume from that turns out damaged as it loads (a block that does not
        match its checksum, an unreadable entry) is skipped, with a warning, for the newest one
        before it (returned); a ``checkpoint`` named raises :class:`DamagedCheckpoint`."""
        if checkpoint is not None:
            self._load(state, checkpoint)
            return checkpoint
        while self.resume_from is not None:
            try:
                self._load(state, self.resume_from)
                return self.resume_from
            except DamagedCheckpoint as e:
                self.resume_from = self._before(self.resume_from, e)
        return None

    def _before(self, damaged: Checkpoint, error: DamagedCheckpoint) -> Checkpoint:
        """Collective. The newest checkpoint older than ``damaged`` (which the store skips from now
        on, and prunes as damaged), checked for this run to save after, as at start-up."""
        store = self._store()

        def older() -> Checkpoint | None:
            store.damaged[damaged.step] = str(error)
            checkpoint = store.newest()  # warns that it skips the damaged one
            if checkpoint is not None:
                store.check_claimable(self.due, after=checkpoint.step)
            return checkpoint

        checkpoint = decided_by_main(older, self.env)
        if checkpoint is None:  # and the model may hold part of the damaged one: no fresh start
            raise CheckpointError(
                f"checkpoint {damaged.url} is damaged ({error}) and no checkpoint before it loads: move it "
                "out of --checkpoint_dir to start from step 0"
            )
        return checkpoint

    def _load(self, state: TrainState, checkpoint: Checkpoint) -> None:
        """Collective. Loads ``checkpoint`` into the model, optimizers and ``state``."""
        check_compatible(checkpoint, self.cfg)
        loaded = TrainState(self.env.rank, checkpoint.manifest["progress"]["step"])
        entries = self.entries(loaded)
        saved_world_size = checkpoint.manifest["world_size"]
        if saved_world_size != self.env.world_size:
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
            self.checkpointed.tables,
            self.cfg.training.embedding_optimizer,
            loaded.step,
        )
        destinations = {**entries, "optimizer": resharding.destinations}
        split = None
        if self.checkpointed.tables.managed and splits(saved_world_size, self.env.world_size):
            split = IdMapSplit(self.checkpointed.model, destinations, saved, self.checkpointed.tables, saved_world_size)
            destinations = split.destinations
        self._store().load(checkpoint, destinations, saved)
        if split is not None:
            split.apply()
        if self.checkpointed.tables.managed:
            settle_loaded_state(self.checkpointed.model)
        resharding.apply()
        optimizer.load_state_dict(optimizer_state)
        state.load_state_dict(entries)
        if state.validations is not None:
            state.validations.resume(checkpoint.manifest["progress"].get("validations", {}))
        if self.env.is_main and resharding.converted:
            logger.info("%s", _describe_resharding(checkpoint, self.checkpointed.plan, resharding.converted))

    def save(self, state: TrainState) -> str:
        """Collective. Saves the checkpoint of ``state.step``; returns its URL. Synchronous, or
        with --checkpoint_async returns once the state is copied to host memory (after the save
        before it, if still in flight, is committed); it commits once written."""
        start = time.perf_counter()
        self.wait()
        self.waits.append(time.perf_counter() - start)
        self._warn_if_waited(state.step)
        entries, manifest, store = self.entries(state), self._manifest(state), self._store()
        best_step = manifest["progress"]["validations"].get("best_step")
        if self._async is None:
            store.save(state.step, entries, manifest, self.env, best_step)
        else:
            group, stager = self._async
            self._in_flight = store.save_async(state.step, entries, manifest, self.env, group, stager, best_step)
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
        """Waits for the save in flight, then gives up the folder's lease: call it before the
        process group goes."""
        try:
            self.wait()
        finally:
            if self.store is not None:
                self.store.release()
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
            "model": self.cfg.model_signature(),
            "sharding_plan": self.checkpointed.plan,
            "config": config_record(self.cfg),
            "columns": self.checkpointed.columns,
            "versions": package_versions(),
            "run_id": self._store().run_id,
        }

    def _store(self) -> CheckpointStore:
        """The store of --checkpoint_dir, for a save or an explicit restore, which need one."""
        assert self.store is not None, "a run without --checkpoint_dir neither saves nor restores"
        return self.store
