"""The DLRM's evaluation metrics, synced across ranks (torchmetrics)."""

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torchrec.datasets.utils import Batch


class ClickMetrics:
    """AUROC, log loss and accuracy of the model's click predictions on one split.

    ``compute`` gathers the state of every rank, so each rank gets the metrics of the whole
    split. With a ``teacher`` (synthetic data: the logits of the hidden model that labels a batch)
    it also computes the teacher's own AUROC on the same samples: the ceiling the model's AUROC
    can approach. :meth:`update` takes what the shared evaluation loop hands every app's metrics.
    On a split of one class AUROC is undefined: NaN, where torchmetrics says 0 (with a warning in
    each rank's stderr), which a run would have kept as its best validation.
    """

    def __init__(self, device: torch.device, teacher: Callable[[Batch], torch.Tensor] | None = None) -> None:
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
        self._click_rate = MeanMetric().to(device)
        self._teacher = teacher
        self._teacher_auroc = BinaryAUROC().to(device) if teacher is not None else None

    def update(self, batch: Batch, outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Takes a batch and ``DLRMTrain``'s outputs for it: (loss, logits, labels)."""
        _, logits, labels = outputs
        logits = logits.reshape(-1).float()
        labels = labels.reshape(-1)
        probs = torch.sigmoid(logits)
        targets = labels.long()
        self._metrics["auroc"].update(probs, targets)
        self._click_rate.update(labels.float())
        self._metrics["accuracy"].update(probs, targets)
        self._metrics["log_loss"].update(F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none"))
        if self._teacher is not None and self._teacher_auroc is not None:
            self._teacher_auroc.update(self._teacher(batch).reshape(-1).to(logits.device), targets)

    def compute(self) -> dict[str, float]:
        results = {name: value.item() for name, value in self._metrics.compute().items()}
        if self._teacher_auroc is not None:
            results["auroc_ceiling"] = self._teacher_auroc.compute().item()
        if self._click_rate.compute().item() in (0.0, 1.0):
            results.update({name: math.nan for name in ("auroc", "auroc_ceiling") if name in results})
        return results
