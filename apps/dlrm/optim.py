"""Optimizers: a fused one for the embedding tables, a regular one for the dense MLPs.

The embedding optimizer is fused into the backward pass (TorchRec's ``apply_optimizer_in_backward``
turns it into an FBGEMM kernel that updates only the rows a batch touched); the dense optimizer
is an ordinary ``torch.optim`` optimizer over the remaining parameters.
"""

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from apps.dlrm.config import TrainConfig
from apps.dlrm.options import ConfigError

# Parameters of the embedding tables have this in their names.
TABLES = "embedding_bag_collection"

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


def check_embedding_optimizer(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.embedding_optimizer == "adam" and device.type != "cuda":
        raise ConfigError(
            "--embedding_optimizer adam needs GPUs: FBGEMM's fused Adam has no CPU kernel; "
            "use rowwise_adagrad, adagrad or sgd on CPU"
        )


def fuse_embedding_optimizer(cfg: TrainConfig, tables: Iterable[nn.Parameter]) -> None:
    """Marks the table parameters so that sharding fuses their optimizer into backward."""
    cls, kwargs = optimizer_class(cfg.embedding_optimizer, cfg.learning_rate)
    apply_optimizer_in_backward(cls, tables, kwargs)


def dense_optimizer(cfg: TrainConfig, model: nn.Module) -> CombinedOptimizer:
    """The optimizer of every parameter whose optimizer is not fused into backward.

    Data-parallel tables are among them: sharding replaces them with plain replicated weights
    (TorchRec's dense kernel) that DDP all-reduces and no fused kernel updates. They keep the
    embedding optimizer and learning rate; the MLPs get the dense ones.
    """
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    groups = {
        "dense": ({n: p for n, p in params.items() if TABLES not in n}, cfg.dense_optimizer, cfg.dense_lr),
        "data_parallel_tables": (
            {n: p for n, p in params.items() if TABLES in n}, cfg.embedding_optimizer, cfg.learning_rate,
        ),
    }
    optimizers = []
    for name, (group, optimizer, lr) in groups.items():
        if group:
            cls, kwargs = optimizer_class(optimizer, lr)
            optimizers.append((name, KeyedOptimizerWrapper(group, lambda ps, c=cls, k=kwargs: c(ps, **k))))
    return CombinedOptimizer(optimizers)
