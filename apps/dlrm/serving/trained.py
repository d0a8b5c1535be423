"""A training run's checkpoint loaded whole into this process: what export and prediction start from.

The checkpoint may have been written by any number of ranks under any sharding: DCP reads every
table's pieces into one whole tensor, as it reshards a resumed run. The reading is the checkpoint
room's (:class:`~apps.core.checkpoint.folder.CheckpointStore`: the commit marker, the manifest,
``.metadata`` through the unpickler that builds nothing but DCP's metadata, the shards' tensors
read without unpickling), here in one process without a process group. Only the model's entries
are read: the optimizer state, often larger than the model, stays where it is.

The whole model must fit in this host's memory: tables larger than one host are not supported.
"""

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.models.dlrm import DLRM

from apps.core.checkpoint.checkpointer import check_compatible
from apps.core.checkpoint.folder import Checkpoint, CheckpointStore
from apps.core.checkpoint.storage.errors import CheckpointError
from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls
from apps.core.zch.modules import settle_loaded_state
from apps.dlrm.config import JobConfig
from apps.dlrm.model import build_model

logger = logging.getLogger(__name__)


class NoCheckpoint(CheckpointError):
    """A folder holds no committed checkpoint of this project."""


@dataclass
class Trained:
    """A trained model, whole, on the CPU and in eval mode, and where it came from."""

    cfg: JobConfig  #: the training run's configuration, as its checkpoint recorded it
    model: DLRM
    checkpoint: Checkpoint
    weights_sha256: str  #: of the model's tensors as loaded (see :func:`weights_sha256`)

    @property
    def columns(self) -> dict[str, Any] | None:
        """The columns the model trained on, as the checkpoint records them (names in feature
        order, kinds); None for a checkpoint written before the record, or of data whose columns
        the options fix (Criteo, synthetic)."""
        return self.checkpoint.manifest.get("columns")

    @property
    def source(self) -> dict[str, Any]:
        """The checkpoint, as a package's manifest and a prediction's report record it: where, which
        step of which run, the SHA-256 of the weights loaded, and of the checkpoint's own checksums
        record (a CRC-32 per block of every shard file, which loading verified; None for a
        checkpoint written before checksums): the same digest means the same shard bytes."""
        checksums = self.checkpoint.manifest.get("checksums")
        return {
            "checkpoint": redact_urls(self.checkpoint.url),
            "step": self.checkpoint.step,
            "run_id": self.checkpoint.manifest.get("run_id"),
            "weights_sha256": self.weights_sha256,
            "checksums_sha256": _json_sha256(checksums) if checksums is not None else None,
        }


def find_checkpoint(checkpoint_dir: str, step: str, option: str = "--checkpoint_dir") -> Checkpoint:
    """The committed checkpoint of ``checkpoint_dir`` that ``step`` names (best: the BEST
    marker's), or a one-line refusal naming what the folder holds."""
    store = CheckpointStore(checkpoint_dir, keep_last=1)  # keep_last matters to writers only
    try:
        committed = store.steps()
    except OSError as e:
        raise CheckpointError(
            f"{option} {redact_urls(checkpoint_dir)} cannot be read ({type(e).__name__}: {e}): check the "
            "URL and the storage's credentials"
        ) from None
    if not committed:
        raise NoCheckpoint(
            f"{option} {redact_urls(checkpoint_dir)} holds no committed checkpoint of this project (no "
            "step_NNNNNNNN folder with a COMMITTED marker): give the --checkpoint_dir a training run wrote"
        )
    if step == "best":
        found = store.best()
    elif step == "latest":
        found = store.newest()
    else:
        found = store.at(int(step)) if int(step) in committed else None
    if found is None:
        best = " and no BEST marker (a run marks one when it validates)" if step == "best" else ""
        raise CheckpointError(
            f"--step {step}: {redact_urls(store.url)} has committed steps {', '.join(map(str, committed))}{best}: "
            "give one of them, or --step latest"
        )
    return found


def training_config(checkpoint: Checkpoint) -> JobConfig:
    """The configuration of the run that wrote ``checkpoint``, from its manifest; a checkpoint
    that is not this project's, or of a version whose options differ, is refused."""
    record = checkpoint.manifest.get("config")
    if not isinstance(record, dict) or "model" not in checkpoint.manifest:
        raise CheckpointError(
            f"{redact_urls(checkpoint.url)} is not a checkpoint of this project (its manifest.json records no "
            "config and model): give the --checkpoint_dir of a components.dlrm:train run"
        )
    try:
        cfg = JobConfig.from_options(_sparse_columns_named(record, checkpoint.manifest.get("columns")))
    except ConfigError as e:
        raise CheckpointError(
            f"{redact_urls(checkpoint.url)} was written by another version of this project ({e}): load it "
            "with the version that trained it"
        ) from None
    check_compatible(checkpoint, cfg)  # the recorded shapes are those the options build
    return cfg


def _sparse_columns_named(record: dict[str, Any], columns: dict[str, Any] | None) -> dict[str, Any]:
    """The options of ``record`` with --sparse_columns the columns the model trained on (``columns``:
    the manifest's record, in feature order) one by one, where --zch_columns names some: the
    managed-collision features then follow from the options alone, as the checkpoint's signature
    records them, wherever the training's files are now (a pattern would need them)."""
    if not record.get("zch_columns") or not columns:
        return record
    return {**record, "sparse_columns": [column["name"] for column in columns["sparse"]]}


def load_trained(checkpoint_dir: str, step: str, option: str = "--checkpoint_dir") -> Trained:
    """The model of the checkpoint of ``checkpoint_dir`` that ``step`` names, loaded whole."""
    checkpoint = find_checkpoint(checkpoint_dir, step, option)
    cfg = training_config(checkpoint)
    cpu = torch.device("cpu")
    module = build_model(cfg.model, dense_device=cpu, table_device=cpu, zch=cfg.zch, managed=cfg.zch_features)
    state = module.state_dict()  # views of the weights: DCP loads into them in place
    logger.info("loading %s (step %d) whole into this process", redact_urls(checkpoint.url), checkpoint.step)
    with warnings.catch_warnings():
        # DCP warns that it loads in one process, without a process group: as intended here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        CheckpointStore(checkpoint_dir, keep_last=1).load(checkpoint, {"model": state})
    settle_loaded_state(module)  # managed-collision tables' id maps: every rank's share merged into one
    model = module.model.eval()
    return Trained(cfg, model, checkpoint, weights_sha256(state))


def _json_sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and bytes, in name order: the same for the
    same weights however they were sharded and stored."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
