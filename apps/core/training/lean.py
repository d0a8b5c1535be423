"""The lean single-rank step: the tables' FBGEMM kernels called directly, without TorchRec's
input and output distribution or DDP.

On one rank, TorchRec's sharded step still runs the machinery of many: the table-wise input
all-to-alls of the batch's keys, lengths and values (with host syncs), the pooled embeddings'
all-to-all in forward and backward, DDP's all-reduce of the dense gradients, and the train
pipeline's rewrite of the model around them. None of it moves or changes a number when every
table is whole on the only rank. The lean step keeps everything TorchRec built (the plan, the
sharded table module with its grouped FBGEMM TBE lookups and fused optimizer, the
``DistributedModelParallel`` whose state dict checkpoints hold) and skips only that machinery:
the sharded module's forward becomes its lookups' kernels called on the batch's
``KeyedJaggedTensor``, DMP is built without DDP, and a plain loop (:class:`LeanPipeline`:
forward, backward, step) drives it. Parameters, optimizer states and
their names are the sharded path's, so a checkpoint of either resumes on the other and reshards to
any world size; on a CPU every step's loss is the sharded path's to the last bit.
"""

from typing import Any, Iterator

import torch
from torch import nn
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.train_pipeline import TrainPipeline
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from apps.core.common.tables import Tables
from apps.core.config import LaunchConfig

#: Sharding types whose tables, on one rank, are whole in one lookup, whose distribution is the
#: identity: table_wise (an all-to-all of one rank) and data_parallel (no distribution at all).
#: The others change ids (row-wise bucketing) or split tables into shards to put together again.
LEAN_SHARDING_TYPES = ("table_wise", "data_parallel")
#: --pipeline values whose only work on one rank is what the lean step skips or does itself
#: (the batch's copy to the device): :class:`LeanPipeline` takes their place.
LEAN_PIPELINES = ("sparse_dist", "sparse_dist_lite", "base")


def lean_step_refusal(cfg: LaunchConfig, tables: Tables, sharding_types: list[str], world_size: int) -> str:
    """Why this run takes TorchRec's sharded step rather than the lean one, in a few words for the
    log; empty when the lean step runs. ``sharding_types``: the plan's, one per table."""
    if cfg.lean_step == "false":
        return "--lean_step false"
    if world_size != 1:
        return f"{world_size} ranks"
    if tables.managed:
        return "managed-collision tables (--categorical_ids zch), whose ids TorchRec's sharded module maps to rows"
    if not tables.pooled:
        return f"the tables are an {tables.kind}, which the lean step does not look up"
    if cfg.pipeline not in LEAN_PIPELINES:
        return f"--pipeline {cfg.pipeline}"
    others = sorted(set(sharding_types) - set(LEAN_SHARDING_TYPES))
    if others:
        return f"{'/'.join(others)} tables"
    return ""


def step_kind(refusal: str, pipeline: str) -> str:
    """Which step trains, for the log's one line: the lean one, or TorchRec's ``pipeline`` and
    why (``refusal``: :func:`lean_step_refusal`'s)."""
    if not refusal:
        return "lean (one rank: the tables' FBGEMM kernels called directly, no all-to-alls, no DDP)"
    return f"TorchRec's sharded step ({pipeline}); not the lean one: {refusal}"


class DirectLookup:
    """The forward of a ``ShardedEmbeddingBagCollection`` whose tables are all on this, the only,
    rank: the batch's features in the order the sharded module's lookups take them, each lookup
    (grouped FBGEMM TBEs, their optimizer fused into backward) called on its share, and the
    pooled embeddings as the ``KeyedTensor`` its output distribution would have made of them.

    Not a module (it would be registered as a submodule, its state dict in the model's): it
    holds the sharded module's own lookups, nothing of its own.
    """

    def __init__(self, tables: ShardedEmbeddingBagCollection) -> None:
        self._lookups = [_kernel_of(lookup) for lookup in tables._lookups]
        shardings = tables._embedding_shardings
        #: The features in the order the lookups take them.
        self.feature_names = [name for sharding in shardings for name in sharding.feature_names()]
        self._feature_splits = [len(sharding.feature_names()) for sharding in shardings]
        self._embedding_names: list[str] = tables._embedding_names
        self._embedding_dims: list[int] = tables._embedding_dims
        self._order: tuple[list[str], list[int], torch.Tensor] | None = None

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        features = self._in_lookup_order(features)
        shares = features.split(self._feature_splits) if len(self._lookups) > 1 else [features]
        pooled = [lookup(share) for lookup, share in zip(self._lookups, shares)]
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._embedding_dims,
            values=pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1),
            key_dim=1,
        )

    def _in_lookup_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` permuted into the lookups' order (as the input distribution does), the
        permutation found once for the batches' order of keys."""
        keys = features.keys()
        if keys == self.feature_names:
            return features
        if self._order is None or self._order[0] != keys:
            indices = [keys.index(name) for name in self.feature_names]
            self._order = (keys, indices, torch.tensor(indices, dtype=torch.int32, device=features.device()))
        return features.permute(self._order[1], self._order[2])


def _kernel_of(lookup: nn.Module) -> nn.Module:
    """What to call for a grouped lookup's share of the features: its one kernel module (around
    an FBGEMM TBE), as the lookup would call it, where it holds one and passes the features on
    unchanged; else the lookup itself (it splits the features among several kernels, or weighs
    or processes them first)."""
    kernels: Any = getattr(lookup, "_emb_modules", [])
    configs: Any = getattr(lookup, "grouped_configs", [])
    if len(kernels) == 1 and not (configs[0].is_weighted or configs[0].has_feature_processor):
        return kernels[0]
    return lookup


def call_tables_directly(model: nn.Module, tables: Tables) -> None:
    """Makes each of ``model``'s (the unwrapped DMP module's) sharded table collections look its
    tables up directly, in place: its forward, not its state, changes (as TorchRec's train
    pipelines replace it with their own)."""
    for path in tables.paths:
        sharded: Any = model.get_submodule(path)
        sharded.forward = DirectLookup(sharded)


class LeanPipeline(TrainPipeline[Pipelineable, Any]):
    """The lean step's loop, in TorchRec's pipeline interface: the next batch to the device,
    gradients cleared, forward, backward (which updates the tables' rows in FBGEMM's fused
    kernels), the dense optimizers' step; returns the model's outputs. Nothing more: no streams,
    events or profiler ranges, which cost a CPU step more than its arithmetic at small shapes."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        super().__init__()
        self._model, self._optimizer, self._device = model, optimizer, device

    def progress(self, dataloader_iter: Iterator[Pipelineable]) -> Any:
        batch = next(dataloader_iter)
        if self._device.type != "cpu":  # a CPU rank's batches are made where it computes
            batch = batch.to(self._device, non_blocking=True)
        self._optimizer.zero_grad()
        loss, outputs = self._model(batch)
        loss.backward()
        self._optimizer.step()
        return outputs
