"""Evaluation metrics synced across ranks (torchmetrics), and a throughput meter."""

import time

import torch
import torch.nn.functional as F


class EvalMetrics:
    """AUROC, log loss and accuracy of the model's click predictions on one split.

    ``compute`` gathers the state of every rank, so each rank gets the metrics of the whole
    split. With ``teacher`` logits (synthetic data) it also computes the teacher's own AUROC on
    the same samples: the ceiling the model's AUROC can approach.
    """

    def __init__(self, device: torch.device, with_teacher: bool = False) -> None:
        # Imported at the first evaluation, not at start-up: torchmetrics imports matplotlib's
        # pyplot, 1-2 s that every trainer would spend before its first step.
        from torchmetrics import MeanMetric, MetricCollection
        from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

        self._metrics = MetricCollection(
            {
                "auroc": BinaryAUROC(),
                "accuracy": BinaryAccuracy(),
                "log_loss": MeanMetric(),
            }
        ).to(device)
        self._teacher = BinaryAUROC().to(device) if with_teacher else None

    def update(self, logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None = None) -> None:
        logits = logits.reshape(-1).float()
        labels = labels.reshape(-1)
        probs = torch.sigmoid(logits)
        targets = labels.long()
        self._metrics["auroc"].update(probs, targets)
        self._metrics["accuracy"].update(probs, targets)
        self._metrics["log_loss"].update(F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none"))
        if self._teacher is not None and teacher is not None:
            self._teacher.update(teacher.reshape(-1).to(logits.device), targets)

    def compute(self) -> dict[str, float]:
        results = {name: value.item() for name, value in self._metrics.compute().items()}
        if self._teacher is not None:
            results["auroc_ceiling"] = self._teacher.compute().item()
        return results


class Throughput:
    """Samples per second over the timed intervals added to it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.samples = 0

    def add(self, seconds: float, samples: int) -> None:
        self.seconds += seconds
        self.samples += samples

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Stopwatch:
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or since creation)."""
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        return elapsed
