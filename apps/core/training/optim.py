"""Optimizers and the learning-rate schedule.

The embedding optimizer is fused into the backward pass (TorchRec's ``apply_optimizer_in_backward``
turns it into an FBGEMM kernel that updates only the rows a batch touched); the dense optimizer
is an ordinary ``torch.optim`` optimizer over the remaining parameters. Both are combined into
one ``CombinedOptimizer`` that the pipeline steps, the schedule scales and checkpoints save.
"""

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from apps.core.common.tables import Tables
from apps.core.config import TrainingConfig

# One epsilon for every Adagrad variant, so that the fused FBGEMM kernels and a plain
# ``torch.optim`` reference compute the same update.
ADAGRAD_EPS = 1e-8

_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "rowwise_adagrad": (RowWiseAdagrad, {"eps": ADAGRAD_EPS}),
    "adagrad": (torch.optim.Adagrad, {"eps": ADAGRAD_EPS}),
    "sgd": (torch.optim.SGD, {}),
    "adam": (torch.optim.Adam, {}),
}


def optimizer_class(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    cls, kwargs = _OPTIMIZERS[name]
    return cls, {"lr": lr, **kwargs}


def fuse_embedding_optimizer(cfg: TrainingConfig, tables: Iterable[nn.Parameter]) -> None:
    """Marks the table parameters so that sharding fuses their optimizer into backward."""
    cls, kwargs = optimizer_class(cfg.embedding_optimizer, cfg.learning_rate)
    apply_optimizer_in_backward(cls, tables, kwargs)


def dense_optimizer(cfg: TrainingConfig, model: nn.Module, tables: Tables) -> CombinedOptimizer:
    """The optimizer of every parameter whose optimizer is not fused into backward.

    Data-parallel tables are among them: sharding replaces them with plain replicated weights
    (TorchRec's dense kernel) that DDP all-reduces and no fused kernel updates. They keep the
    embedding optimizer and learning rate; the MLPs get the dense ones.
    """
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    in_tables = [f"{path}." for path in tables.paths]  # in their names, below DMP's and DDP's prefixes

    def of_tables(name: str) -> bool:
        return any(path in name for path in in_tables)

    groups = {
        "dense": (
            {n: p for n, p in params.items() if not of_tables(n)},
            cfg.dense_optimizer,
            cfg.dense_lr,
        ),
        "data_parallel_tables": (
            {n: p for n, p in params.items() if of_tables(n)},
            cfg.embedding_optimizer,
            cfg.learning_rate,
        ),
    }
    optimizers = []
    for name, (group, optimizer, lr) in groups.items():
        if group:
            cls, kwargs = optimizer_class(optimizer, lr)
            optimizers.append((name, KeyedOptimizerWrapper(group, lambda ps, c=cls, k=kwargs: c(ps, **k))))
    return CombinedOptimizer(optimizers)


def training_optimizer(cfg: TrainingConfig, model: DistributedModelParallel, tables: Tables) -> CombinedOptimizer:
    """Every optimizer of the sharded model in one.

    The fused optimizer's update happens inside backward; it is here so that the pipeline's
    ``zero_grad``/``step`` hand it the scheduled learning rate, and so that checkpoints save it.
    """
    return CombinedOptimizer([("fused", model.fused_optimizer), ("dense", dense_optimizer(cfg, model, tables))])


@dataclass(frozen=True)
class LRShape:
    """Where the learning rates warm up and decay, in steps of this run."""

    warmup_steps: int
    decay_start: int
    decay_steps: int

    @classmethod
    def of(cls, cfg: TrainingConfig, run_steps: int) -> "LRShape":
        """The options' shape; a fraction (--lr_warmup_fraction, --lr_decay_fraction) is of the
        run's ``run_steps``, which the data decides."""
        if cfg.lr_decay_fraction:
            decay_steps = max(1, round(cfg.lr_decay_fraction * run_steps))
            decay_start = run_steps - decay_steps
        else:
            decay_steps, decay_start = cfg.lr_decay_steps, cfg.lr_decay_start
        warmup = round(cfg.lr_warmup_fraction * run_steps) if cfg.lr_warmup_fraction else cfg.lr_warmup_steps
        return cls(warmup, decay_start, decay_steps)


def lr_scale(shape: LRShape, step: int) -> float:
    """The factor on the learning rates at 0-based ``step``, as in TorchRec's DLRM example.

    Linear warmup over ``warmup_steps``; from ``decay_start`` a polynomial (power 2) decay over
    ``decay_steps``, then frozen at its last value.
    """
    if step < shape.warmup_steps:
        return (step + 1) / shape.warmup_steps
    if shape.decay_steps:
        decayed = min(step - shape.decay_start, shape.decay_steps - 1)
        if decayed >= 0:
            return ((shape.decay_steps - decayed) / shape.decay_steps) ** 2
    return 1.0


class LRSchedule:
    """Sets every param group's learning rate from the step: a pure function, so resuming at a
    step restores the schedule exactly without any saved scheduler state."""

    def __init__(self, shape: LRShape, optimizer: torch.optim.Optimizer) -> None:
        self._shape = shape
        self._groups = optimizer.param_groups
        self._base = [group["lr"] for group in self._groups]

    def apply(self, step: int) -> float:
        """Sets the learning rates for 0-based ``step``; returns the scale applied."""
        scale = lr_scale(self._shape, step)
        for group, base in zip(self._groups, self._base):
            group["lr"] = base * scale
        return scale
