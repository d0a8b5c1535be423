"""The HSTU as the shared Trainer sees it (:data:`HSTU`), and the HSTU's :class:`Trainer`.

What is the HSTU's own: its model (``HSTUTrain``) and its tables (an ``EmbeddingCollection``), the
users' event sequences, leave-last-out metrics (HR@10, NDCG@10, MRR with the planted process's
ceiling on synthetic data; AUROC per action for ranking) and summary.json's figures of them.
"""

import math
from typing import Any, Callable, cast

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel

from apps.core.checkpoint.folder import Checkpoint
from apps.core.common.distributed import DistEnv
from apps.core.common.tables import Tables
from apps.core.data import DataSource, RankShare
from apps.core.training import trainer
from apps.core.zch.config import zch_of
from apps.hstu.config import NAME, JobConfig
from apps.hstu.data import make_dataset
from apps.hstu.data.batch import ACTION, NEGATIVE, SequenceBatch
from apps.hstu.data.source import SequenceSource
from apps.hstu.metrics import ActionAUROC, RetrievalMetrics
from apps.hstu.model import MANAGED_TABLES, TABLES, EvalOutput, HSTUTrain, build_model, table_configs

#: The cut-off of HR@K and NDCG@K.
K = 10
#: What a validation's ceilings are, said once beside the first.
CEILING_NOTE = (
    "hr@10_ceiling, ndcg@10_ceiling, mrr_ceiling: what the hidden process that generates the "
    "synthetic users allows, the best any model can reach"
)
ACTION_CEILING_NOTE = (
    "auroc_ceiling: the AUROC that the probabilities the synthetic actions are drawn with reach on the "
    "same target events, the Bayes-optimal ranking scores"
)


class SequenceMetrics:
    """One split's leave-last-out metrics over every rank's users: HR@10, NDCG@10 and MRR of the
    target item (retrieval, with ``ceiling``'s values beside them as ``<name>_ceiling``), or the
    AUROC of each action head on the target event and their mean, ``auroc`` (ranking, with
    ``auroc_ceiling`` beside it where ``action_oracle`` gives the probabilities the actions are drawn with)."""

    def __init__(
        self,
        cfg: JobConfig,
        device: torch.device,
        ceiling: dict[str, float] | None,
        action_oracle: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.ceiling = ceiling or {}
        self.retrieval = RetrievalMetrics(K, device) if cfg.model.objective == "retrieval" else None
        ranking = cfg.model.objective == "ranking"
        self.actions = ActionAUROC(cfg.model.num_actions) if ranking else None
        # The oracle's scores of the same targets, and their AUROC.
        self.oracle = (action_oracle, ActionAUROC(cfg.model.num_actions)) if ranking and action_oracle else None

    def update(self, batch: SequenceBatch, outputs: EvalOutput) -> None:
        """Takes the results of ``batch``'s users but its padding (per user, in batch order)."""
        counted = batch.counted
        if self.retrieval is not None:
            assert outputs.ranks is not None
            self.retrieval.update(outputs.ranks[:counted])
        if self.actions is not None:
            assert outputs.action_logits is not None and outputs.action_labels is not None
            self.actions.update(outputs.action_logits[:counted], outputs.action_labels[:counted])
        if self.oracle is not None:
            oracle, oracle_auroc = self.oracle
            assert outputs.target_items is not None and outputs.action_labels is not None
            oracle_auroc.update(oracle(outputs.target_items[:counted]), outputs.action_labels[:counted])

    def compute(self) -> dict[str, float]:
        if self.retrieval is not None:
            results = self.retrieval.compute()
            return {**results, **{f"{name}_ceiling": value for name, value in self.ceiling.items()}}
        assert self.actions is not None
        results = self.actions.compute()
        results["auroc"] = _mean_auroc(results)
        if self.oracle is not None:
            results["auroc_ceiling"] = _mean_auroc(self.oracle[1].compute())
        return results


def _mean_auroc(per_action: dict[str, float]) -> float:
    """The mean of the actions' AUROCs; actions never (or always) taken on the split have none
    (NaN) and are left out."""
    measured = [value for value in per_action.values() if not math.isnan(value)]
    return sum(measured) / len(measured) if measured else math.nan


class HSTUApp:
    """The HSTU app (:class:`~apps.core.training.app.TrainingApp` of :class:`JobConfig`), of
    ``tables``: plain ones, or a managed-collision item table (:data:`HSTU_ZCH`)."""

    def __init__(self, tables: Tables = TABLES) -> None:
        self.tables = tables

    name: str = NAME
    curves: tuple[tuple[str, str], ...] = (
        (f"ndcg@{K}", f"validation NDCG@{K}"),
        (f"hr@{K}", f"validation HR@{K}"),
        ("auroc", "validation AUROC (ranking)"),
    )
    notes: dict[str, str] = {f"hr@{K}_ceiling": CEILING_NOTE, "auroc_ceiling": ACTION_CEILING_NOTE}

    def build_model(self, cfg: JobConfig, dense_device: torch.device) -> nn.Module:
        return build_model(cfg.model, dense_device=dense_device, zch=zch_of(cfg))

    def pooling_factors(self, cfg: JobConfig) -> dict[str, float]:
        """Ids a user looks up in each table, at most: its events (and the item table its
        training negatives too)."""
        ids = {NEGATIVE: cfg.model.num_negatives, ACTION: cfg.model.max_seq_len}
        return {
            table.name: float(sum(ids.get(feature, cfg.model.max_seq_len) for feature in table.feature_names))
            for table in table_configs(cfg.model, zch_of(cfg) is not None)
        }

    def make_data(self, cfg: JobConfig, env: DistEnv, checkpoint: Checkpoint | None = None) -> SequenceSource:
        """This rank's sequences; a checkpoint records no columns of them (the options fix them)."""
        share = RankShare.of(cfg.training, env.rank, env.world_size)
        return make_dataset(cfg.model, cfg.data, share, env.device)

    def eval_metrics(self, cfg: JobConfig, data: DataSource, split: str, device: torch.device) -> SequenceMetrics:
        """The split's metrics; on validation data with a known ceiling (synthetic), beside it."""
        sequences = cast(SequenceSource, data)  # what make_data made
        if split != "val":
            return SequenceMetrics(cfg, device, None)
        return SequenceMetrics(cfg, device, sequences.ceiling(), sequences.action_oracle())

    def eval_outputs(self, cfg: JobConfig, model: nn.Module, batch: SequenceBatch) -> EvalOutput:
        """``HSTUTrain.evaluate``: the target's rank among the candidates, or the action logits."""
        # DMP's module: the HSTUTrain inside, its tables sharded (evaluate is no forward to wrap).
        unwrapped = cast(HSTUTrain, model.module if isinstance(model, DistributedModelParallel) else model)
        return unwrapped.evaluate(batch, cfg.data.eval_chunk_items)

    def summary(self, val: dict[str, float], test: dict[str, float], best: dict[str, float]) -> dict[str, Any]:
        """Every metric of the last validation (ceilings included) and of the test, and the best
        validation's."""
        return {
            **{name if name.endswith("_ceiling") else f"val_{name}": value for name, value in val.items()},
            **{f"test_{name}": value for name, value in test.items() if not name.endswith("_ceiling")},
            **{f"best_val_{name}": value for name, value in best.items() if not name.endswith("_ceiling")},
        }


#: The HSTU app.
HSTU = HSTUApp()
#: The HSTU app of a managed-collision item table (--categorical_ids zch).
HSTU_ZCH = HSTUApp(MANAGED_TABLES)


def app_for(cfg: JobConfig) -> HSTUApp:
    """The HSTU app of ``cfg``'s tables (:class:`~apps.core.training.app_spec.AppTraining`)."""
    return HSTU if zch_of(cfg) is None else HSTU_ZCH


class Trainer(trainer.Trainer[JobConfig]):
    """An HSTU training run: the shared Trainer, given the HSTU app."""

    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        super().__init__(app_for(cfg), cfg, env)
