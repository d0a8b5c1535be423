"""TorchRec's managed-collision modules as the apps build, shard, load and count them (see
:mod:`apps.core.zch`)."""

import functools
from typing import Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

from apps.core.common.distributed import gather_rows
from apps.core.zch.config import INPUT_HASH_SIZE, PLANNER_BUCKETS, ZchConfig

#: TorchRec's eviction policies, by --zch_eviction_policy.
EVICTION_POLICIES: dict[str, type[MCHEvictionPolicy]] = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance_lfu": DistanceLFU_EvictionPolicy,
}
#: Bytes of each entry of the state's int64 buffers.
INT64_BYTES = 8


def settle_loaded_state(model: nn.Module) -> None:
    """Does for every MCH module of ``model`` what TorchRec's hook does after ``load_state_dict``,
    which DCP's in-place load skips: checks that the module's share of rows is made of whole shares
    of the world that saved it (or, split from another world's by :mod:`apps.core.checkpoint.id_maps`,
    of this world's), and sorts its ids (merged shares arrive one after the other, each sorted
    alone; the module's lookup is a binary search)."""
    for module in model.modules():
        if isinstance(module, MCHManagedCollisionModule):
            module.validate_state()


def managed_collisions(
    tables: Sequence[BaseEmbeddingConfig], cfg: ZchConfig, device: torch.device
) -> ManagedCollisionCollection:
    """TorchRec's collection of one MCH module per table, sized as the table, on ``device``."""
    modules = {
        table.name: MCHManagedCollisionModule(
            zch_size=table.num_embeddings,
            device=device,
            eviction_policy=EVICTION_POLICIES[cfg.zch_eviction_policy](),
            eviction_interval=cfg.zch_eviction_interval,
            input_hash_size=INPUT_HASH_SIZE,
            name=table.name,
            buckets=PLANNER_BUCKETS,
        )
        for table in tables
    }
    return ManagedCollisionCollection(modules, list(tables))


def state_bytes(collection: nn.Module) -> int:
    """Bytes of the id-to-row state of every MCH module under ``collection`` (unsharded, on any
    device: meta tensors have their shapes), that sharding splits row-wise with the tables."""
    return sum(
        buffer.numel() * buffer.element_size()
        for module in collection.modules()
        if isinstance(module, MCHManagedCollisionModule)
        for name, buffer in module.named_buffers(recurse=False)
        if name.startswith("_mch_") and name not in module._non_persistent_buffers_set
    )


def history_bytes(module: MCHManagedCollisionModule, ids_per_step: int) -> int:
    """Bytes of the buffer where TorchRec's ``module`` gathers one rank's ids between two evictions
    (its size: the first step's ids times the interval, plus a quarter), and the per-id step
    numbers the lru and distance_lfu policies keep beside them."""
    per_id = 1 + sum(info.is_history_metadata for info in module._eviction_policy.metadata_info)
    return int(ids_per_step * module._eviction_interval * 1.25) * per_id * INT64_BYTES


def bytes_per_rank(collection: nn.Module, world_size: int, ids_per_step: dict[str, float]) -> int:
    """Memory of one rank's share of the id maps under ``collection`` (unsharded, e.g. on the meta
    device) and of the buffers their modules gather ids in: what TorchRec's planner does not count.
    ``ids_per_step``: per table, the ids one rank's batch holds (a rank's module receives a
    ``1/world_size`` share of every rank's ids: one batch's worth, on average)."""
    history = sum(
        history_bytes(module, int(ids_per_step[module._name or ""]))
        for module in collection.modules()
        if isinstance(module, MCHManagedCollisionModule)
    )
    return -(-state_bytes(collection) // world_size) + history


def ids_with_rows(collection: nn.Module) -> dict[str, int]:
    """Per table, how many ids have a row of their own in this process's MCH modules (every row
    of an unsharded module; this rank's share of a sharded one's)."""
    counts: dict[str, int] = {}
    for module in collection.modules():
        if isinstance(module, MCHManagedCollisionModule):
            table = module._name or ""
            counts[table] = counts.get(table, 0) + _own_ids(module).numel()
    return counts


def held_ids(collection: nn.Module) -> torch.Tensor:
    """Collective (every rank calls it). The ids that have a row of their own in the MCH modules
    of ``collection`` (one table's), of every rank's share, in rank order: what "every item" is
    for a managed-collision table, the same on every rank."""
    own = [_own_ids(module) for module in collection.modules() if isinstance(module, MCHManagedCollisionModule)]
    return gather_rows(torch.cat(own))


def _own_ids(module: MCHManagedCollisionModule) -> torch.Tensor:
    """The ids in ``module``'s map (its slots without one hold the int64 maximum)."""
    ids = module._mch_sorted_raw_ids
    return ids[ids != torch.iinfo(torch.int64).max]


def reset_rows_on_host(model: nn.Module) -> None:
    """Gives the CPU tables of ``model``'s sharded managed-collision modules FBGEMM's reset of a
    row that changes hands, in place.

    When an id takes another's row, TorchRec re-initialises the row's weights and has FBGEMM zero
    its optimizer state (``reset_embedding_weight_momentum``, which does so for row-wise Adagrad,
    the state that would otherwise scale the new id's updates by the old id's gradients). FBGEMM's
    operator for it (``fbgemm::reset_weight_momentum``) has a CUDA kernel only, and is handed the
    device's tensors, which a CPU table leaves empty: this does the same to a CPU table's host
    tensors."""
    for module in model.modules():
        if isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            for tbe, _ in module._table_to_tbe_and_index.values():
                if tbe.current_device.type == "cpu":
                    tbe.reset_embedding_weight_momentum = functools.partial(_reset_host_rows, tbe)


@torch.no_grad()
def _reset_host_rows(
    tbe: SplitTableBatchedEmbeddingBagsCodegen,
    pruned_indices: torch.Tensor,
    pruned_indices_offsets: torch.Tensor,
    logical_table_ids: torch.Tensor,
    buffer_ids: torch.Tensor,
) -> None:
    """FBGEMM's ``reset_embedding_weight_momentum`` on a CPU table: entry i of ``logical_table_ids``
    has the rows ``pruned_indices[pruned_indices_offsets[i]:pruned_indices_offsets[i + 1]]``, whose
    weights and row-wise Adagrad state become 0 (other optimizers' state stays, as in FBGEMM)."""
    if tbe.optimizer != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return
    bounds = pruned_indices_offsets.tolist()
    for i, table in enumerate(logical_table_ids.tolist()):
        rows = pruned_indices[bounds[i] : bounds[i + 1]].long()
        dim = int(tbe.D_offsets[table + 1] - tbe.D_offsets[table])
        columns = torch.arange(dim, dtype=torch.long)
        tbe.weights_host[tbe.weights_offsets[table] + rows[:, None] * dim + columns] = 0
        tbe.momentum1_host[tbe.momentum1_offsets[table] + rows] = 0
