"""What an app plugs into the shared :class:`~apps.core.training.trainer.Trainer`: :class:`TrainingApp`.

The Trainer owns the recipe every app shares (plan and shard the tables, fuse their optimizer,
step TorchRec's pipeline, validate, checkpoint, report); an app says what is its own, as
torchtitan's ``TrainSpec`` does: its model, where its tables are, its data, its evaluation
metrics and the figures of its summary. Each is a method of one object, typed by the app's
config (``C``), which composes the shared sections (:class:`~apps.core.config.SharedSections`).
"""

from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torchrec.streamable import Pipelineable

from apps.core.checkpoint.folder import Checkpoint
from apps.core.common.distributed import DistEnv
from apps.core.common.tables import Tables
from apps.core.config import SharedSections
from apps.core.data import DataSource

C = TypeVar("C", bound=SharedSections, contravariant=True)


class EvalMetrics(Protocol):
    """One split's metrics, fed batch by batch on each rank and computed over all ranks."""

    def update(self, batch: Pipelineable, outputs: Any) -> None:
        """Takes one batch (as the data source gave it, on the host) and the app's
        :meth:`TrainingApp.eval_outputs` for it."""
        ...

    def compute(self) -> dict[str, float]:
        """Collective. The split's metrics over every rank's batches."""
        ...


class TrainingApp(Protocol[C]):
    """An app, as the shared Trainer and plan code see it."""

    #: The app's name (:attr:`apps.core.training.app_spec.AppSpec.name`): its runs' folders are named after
    #: it where TorchX did not name the job.
    name: str
    #: Where the model's TorchRec table collections are, and which holds each table (what plans and
    #: checkpoints key on).
    tables: Tables
    #: Validation metrics drawn in curves.png beside the training loss: (metric, title) each.
    curves: tuple[tuple[str, str], ...]
    #: What a validation metric means, logged once beside the first validation that has it.
    notes: dict[str, str]

    def build_model(self, cfg: C, dense_device: torch.device) -> nn.Module:
        """The training module (forward: batch -> ``(loss, (loss.detach(), ...))``, as TorchRec's
        ``DLRMTrain``, which its train pipelines run), tables on the meta
        device (DMP materialises each rank's shards only), the dense part on ``dense_device``
        from the current RNG state, with the app's dense speed-ups applied."""
        ...

    def pooling_factors(self, cfg: C) -> dict[str, float]:
        """Per table, the ids a sample looks up in it on average, where not one (the planner's
        estimates of input size, comms and compute scale with it)."""
        ...

    def make_data(self, cfg: C, env: DistEnv, checkpoint: Checkpoint | None = None) -> DataSource:
        """This rank's data source; ``checkpoint``: the one whose model it feeds (resumed or
        evaluated), whose manifest's ``columns`` (what :attr:`DataSource.columns` was when it was
        written) say by name which column is which feature: the data feeds them so, or refuses."""
        ...

    def eval_metrics(self, cfg: C, data: DataSource, split: str, device: torch.device) -> EvalMetrics:
        """Fresh metrics of one evaluation of ``split`` (with their ceiling where ``data`` has one)."""
        ...

    def eval_outputs(self, cfg: C, model: nn.Module, batch: Pipelineable) -> Any:
        """What the metrics take of one ``batch`` (on the device) from ``model`` (the sharded
        model, in eval mode, without gradients): e.g. its forward's outputs."""
        ...

    def summary(self, val: dict[str, float], test: dict[str, float], best: dict[str, float]) -> dict[str, Any]:
        """summary.json's fields of the last validation, the test and the best validation."""
        ...
