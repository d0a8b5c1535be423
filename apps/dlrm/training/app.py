"""The DLRM as the shared Trainer sees it (:data:`DLRM`), and the DLRM's :class:`Trainer`.

What is the DLRM's own: TorchRec's ``DLRMTrain`` with its dense speed-ups, its tables (an
``EmbeddingBagCollection``), multi-hot features' pooling factors, the click-log sources, AUROC,
log loss and accuracy (with the synthetic teacher's ceiling), and summary.json's click figures.
"""

from typing import Any, cast

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from apps.core.checkpoint.folder import Checkpoint
from apps.core.common.distributed import DistEnv
from apps.core.common.tables import Tables
from apps.core.data import DataSource, RankShare
from apps.core.training import trainer
from apps.dlrm.config import NAME, JobConfig
from apps.dlrm.data import ClickLogs, make_dataset
from apps.dlrm.data.trained import TrainedColumns
from apps.dlrm.model import MANAGED_TABLES, TABLES, build_model, mixed_tables, speed_up_dense, table_configs
from apps.dlrm.training.metrics import ClickMetrics

#: What the validation's auroc_ceiling is, said once beside the first.
CEILING_NOTE = (
    "auroc_ceiling: the AUROC of the hidden teacher that labels the synthetic data, the best any model can reach"
)


class DLRMApp:
    """The DLRM app (:class:`~apps.core.training.app.TrainingApp` of :class:`JobConfig`), of
    ``tables``: plain ones, managed-collision ones (:data:`DLRM_ZCH`), or both (--zch_columns)."""

    def __init__(self, tables: Tables = TABLES) -> None:
        self.tables = tables

    name: str = NAME
    curves: tuple[tuple[str, str], ...] = (("auroc", "validation AUROC"), ("log_loss", "validation log loss"))
    notes: dict[str, str] = {"auroc_ceiling": CEILING_NOTE}

    def build_model(self, cfg: JobConfig, dense_device: torch.device) -> nn.Module:
        model = build_model(cfg.model, dense_device=dense_device, zch=cfg.zch, managed=cfg.zch_features)
        speed_up_dense(cfg.launch, model, dense_device)
        return model

    def pooling_factors(self, cfg: JobConfig) -> dict[str, float]:
        """With --multi_hot_sizes, each table's ids per sample."""
        if not cfg.model.multi_hot_sizes:
            return {}
        return {table.name: float(size) for table, size in zip(table_configs(cfg.model), cfg.model.multi_hot_sizes)}

    def make_data(self, cfg: JobConfig, env: DistEnv, checkpoint: Checkpoint | None = None) -> ClickLogs:
        columns = checkpoint.manifest.get("columns") if checkpoint is not None else None
        trained = TrainedColumns(columns, checkpoint.url) if checkpoint is not None and columns else None
        share = RankShare.of(cfg.training, env.rank, env.world_size)
        return make_dataset(cfg.model, cfg.data, share, env, trained)

    def eval_metrics(self, cfg: JobConfig, data: DataSource, split: str, device: torch.device) -> ClickMetrics:
        """Click metrics; on validation data with a teacher (synthetic), its AUROC as the ceiling."""
        clicks = cast(ClickLogs, data)  # what make_data made
        return ClickMetrics(device, clicks.teacher() if split == "val" else None)

    def eval_outputs(self, cfg: JobConfig, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, ...]:
        """``DLRMTrain``'s outputs: (loss, logits, labels), copied: with CUDA graphs (--compile_dense
        reduce-overhead) they are in the graphs' memory, which the next batch overwrites."""
        _, outputs = model(batch)
        return tuple(output.clone() for output in outputs)

    def summary(self, val: dict[str, float], test: dict[str, float], best: dict[str, float]) -> dict[str, Any]:
        return {
            "val_auroc": val["auroc"],
            "val_log_loss": val["log_loss"],
            "val_accuracy": val["accuracy"],
            "auroc_ceiling": val.get("auroc_ceiling"),
            "test_auroc": test["auroc"],
            "test_log_loss": test["log_loss"],
            "test_accuracy": test["accuracy"],
            "best_val_auroc": best.get("auroc"),
            "best_val_log_loss": best.get("log_loss"),
        }


#: The DLRM app.
DLRM = DLRMApp()
#: The DLRM app of managed-collision tables (--categorical_ids zch).
DLRM_ZCH = DLRMApp(MANAGED_TABLES)


def app_for(cfg: JobConfig) -> DLRMApp:
    """The DLRM app of ``cfg``'s tables."""
    managed = cfg.zch_features
    if not managed:
        return DLRM
    if len(managed) == cfg.model.num_sparse_features:
        return DLRM_ZCH
    return DLRMApp(mixed_tables([table.name for k, table in enumerate(table_configs(cfg.model)) if k in managed]))


class Trainer(trainer.Trainer[JobConfig]):
    """A DLRM training run: the shared Trainer, given the DLRM app."""

    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        super().__init__(app_for(cfg), cfg, env)
