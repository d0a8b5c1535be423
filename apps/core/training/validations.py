"""The run's validations: which was best and whether training should stop early.

A validation improves when its ``--early_stopping_metric`` beats the best so far by at least
``--early_stopping_min_delta`` (AUROC up, a loss down); after ``--early_stopping_patience``
validations in a row that do not, training stops. The record travels in every checkpoint's
manifest (JSON), so a resumed run keeps its best and its count. A metric the split cannot define
(NaN: AUROC on a split of one class) neither improves nor counts against the patience.
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

from apps.core.config import EvaluationConfig

#: Metrics named so (a loss) are better lower; the others (AUROC, HR@K, NDCG@K) higher.
LOWER_IS_BETTER_SUFFIX = "loss"


@dataclass
class Validations:
    metric: str
    min_delta: float
    patience: int
    best_step: int | None = None
    best: dict[str, float] | None = None  #: the best validation's metrics
    since_best: int = 0  #: validations since the best, none of which improved on it
    stopped_early: bool = False

    @classmethod
    def of(cls, cfg: EvaluationConfig, record: dict[str, Any] | None = None) -> "Validations":
        """A fresh record, or the one a checkpoint carried (``record``, from :meth:`record`)."""
        validations = cls(cfg.early_stopping_metric, cfg.early_stopping_min_delta, cfg.early_stopping_patience)
        for name in ("best_step", "best", "since_best", "stopped_early"):
            if record and name in record:
                setattr(validations, name, record[name])
        return validations

    def add(self, step: int, metrics: dict[str, float]) -> bool:
        """Takes the validation after ``step``; returns whether it is the best so far."""
        if math.isnan(metrics[self.metric]):
            return False
        if self.best is None or self._improves(metrics[self.metric], self.best[self.metric]):
            self.best_step, self.best, self.since_best = step, dict(metrics), 0
            return True
        self.since_best += 1
        self.stopped_early = bool(self.patience) and self.since_best >= self.patience
        return False

    def _improves(self, value: float, best: float) -> bool:
        if self.metric.endswith(LOWER_IS_BETTER_SUFFIX):
            return value < best - self.min_delta
        return value > best + self.min_delta

    def record(self) -> dict[str, Any]:
        """The JSON form a checkpoint's manifest keeps."""
        return {k: v for k, v in asdict(self).items() if k not in ("metric", "min_delta", "patience")}
