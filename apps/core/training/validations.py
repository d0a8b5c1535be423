"""The run's validations, in one place: when the run validates, which validation was best, and
whether training should stop early.

A run validates every ``--val_every_steps`` (by default after every epoch: :class:`RunLength`
works it out) and always after its last step. A validation improves when its
``--early_stopping_metric`` beats the best so far by at least ``--early_stopping_min_delta``
(AUROC up, a loss down); after ``--early_stopping_patience`` validations in a row that do not,
training stops. The record travels in every checkpoint's manifest (JSON), so a resumed run keeps
its best and its count. A metric the split cannot define (NaN: AUROC on a split of one class)
neither improves nor counts against the patience.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from apps.core.config import EvaluationConfig
from apps.core.training.run_length import RunLength

#: Metrics named so (a loss) are better lower; the others (AUROC, HR@K, NDCG@K) higher.
LOWER_IS_BETTER_SUFFIX = "loss"
#: What a checkpoint's manifest keeps of the validations (the rest is the run's options).
RECORDED = ("best_step", "best", "since_best", "stopped_early")


@dataclass
class Validations:
    metric: str
    min_delta: float
    patience: int
    every: int = 0  #: validate after every this many steps (0: only after the last)
    last_step: int = 0  #: the run's last step, after which it always validates
    best_step: int | None = None
    best: dict[str, float] | None = None  #: the best validation's metrics
    since_best: int = 0  #: validations since the best, none of which improved on it
    stopped_early: bool = False
    #: The latest validation's metrics (this process's, not recorded: a run validates after its last step).
    latest: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: EvaluationConfig, run: RunLength) -> "Validations":
        """The validations of a run of ``run``'s length, none taken yet."""
        return cls(
            cfg.early_stopping_metric,
            cfg.early_stopping_min_delta,
            cfg.early_stopping_patience,
            run.val_every,
            run.steps,
        )

    def due(self, step: int) -> bool:
        """Whether the run validates after ``step`` (1-based): every ``every`` and the last."""
        return step == self.last_step or bool(self.every and step % self.every == 0)

    def add(self, step: int, metrics: dict[str, float]) -> bool:
        """Takes the validation after ``step``; returns whether it is the best so far."""
        self.latest = dict(metrics)
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

    def keeps(self, step: int) -> bool:
        """Whether the model after ``step`` is to be kept (checkpointed) to be tested at the end:
        its validation is the best so far, or the last before training stops early."""
        return self.best_step == step or self.stopped_early

    def verdict(self, step: int) -> str:
        """What the log says of the validation after ``step`` (the latest), beside its metrics."""
        if self.best_step == step:
            return "the best so far"
        if math.isnan(self.latest[self.metric]):
            return (
                f"{self.metric} is undefined on this split, which holds one class: hold out more rows "
                "(--eval_fraction, --eval_days), or follow another --early_stopping_metric"
            )
        count = f"{self.since_best} of {self.patience}" if self.patience else f"{self.since_best}"
        return f"no better than step {self.best_step}'s ({count})"

    def stopping(self, step: int) -> str:
        """The log line of a run that stops early after ``step``."""
        return (
            f"stopping early after step {step}: {self.patience} validations without an improvement of "
            f"{self.min_delta:g} in {self.metric}; the best was step {self.best_step}"
        )

    def record(self) -> dict[str, Any]:
        """The JSON form a checkpoint's manifest keeps."""
        return {name: getattr(self, name) for name in RECORDED}

    def resume(self, record: dict[str, Any]) -> None:
        """Takes back the record a checkpoint kept (:meth:`record`; empty: an older checkpoint's)."""
        for name in RECORDED:
            if name in record:
                setattr(self, name, record[name])
