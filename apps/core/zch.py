"""Managed-collision ("zero-collision", zch) embedding tables, for any app: TorchRec's
``ManagedCollisionCollection`` of ``MCHManagedCollisionModule`` s wrapped with the app's tables.

What a zch table is. A hashed table folds every id into its rows, so frequent ids share rows with
rare ones. A zch table of N rows keeps an id-to-row map instead: every ``--zch_eviction_interval``
training steps, TorchRec's module counts the ids seen since the last time and lets the ids its
``--zch_eviction_policy`` ranks highest (lfu: most seen, lru: most recently seen, distance_lfu:
counts divided by the steps since last seen) take the rows of those it ranks lowest; a row that
changes hands is re-initialised (weights and optimizer state). Until an id has a row of its own,
and for every id never seen (evaluation, serving), it is looked up in its rank's share's last row,
which TorchRec keeps for them (a per-rank default embedding that all such ids train together).

Its ids. TorchRec's module takes ids in ``[0, input_hash_size)`` and, sharded row-wise, sends each
id to the rank whose share of that range holds it, so the apps feed it SplitMix64 of the raw value
(of a text's FNV-1a 64) modulo :data:`INPUT_HASH_SIZE`, as ``--categorical_ids hash`` does modulo
the table's size: distinct raw ids then collide with a chance of about n^2/2^64 (none in practice).

Its state (the sorted ids, their rows and the policy's counts or last steps, int64 each) is model
state: TorchRec's sharded module shards it row-wise with the table, as ShardedTensors that DCP
checkpoints with the weights. TorchRec's sharder shards these tables row-wise only
(:data:`SHARDING_TYPES`): each rank remaps the ids of its share of the input range into its rows.
A checkpoint's state resumes on its world size and merges into a world size that divides it (a
merged share's ids and rows are those of the ranks merged, which TorchRec's load checks), down to
the single unsharded module that export and serving load; it cannot be split across more ranks
(:func:`check_world_size`).
"""

import functools
from dataclasses import dataclass
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

from apps.core.common.errors import ConfigError
from apps.core.config import CheckpointConfig, LaunchConfig, require_positive
from apps.core.options import option

#: The --categorical_ids choice that makes every table a managed-collision table.
ZCH = "zch"
#: The range the ids fed to TorchRec's module lie in: its default ``input_hash_size``, the most an
#: int64 holds less one (TorchRec marks an empty slot with the int64 maximum itself).
INPUT_HASH_SIZE = 2**63 - 1
#: TorchRec's eviction policies, by --zch_eviction_policy.
EVICTION_POLICIES: dict[str, type[MCHEvictionPolicy]] = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance_lfu": DistanceLFU_EvictionPolicy,
}
#: What TorchRec's sharder of managed-collision tables offers (its ManagedCollisionCollectionSharder).
SHARDING_TYPES = ("row_wise",)
#: Rows each rank's share of a table needs: TorchRec keeps its last for the ids without a row, so
#: an id of its own needs one more.
MIN_ROWS_PER_RANK = 2
#: What an unsharded MCH module tells TorchRec's planner it splits into (its ``buckets``). The
#: planner of torchrec 1.8 refuses a module whose buckets the world size does not divide (1.6.1 does
#: not ask); sharding rebuilds each rank's module with its own, so this number is read by the
#: planner only: the least common multiple of 1 to 16 times 256, which every world size of up to 16
#: ranks, and those times a power of two up to 256, divides.
PLANNER_BUCKETS = 720_720 * 256
#: Bytes of each entry of the state's int64 buffers.
INT64_BYTES = 8


@dataclass(slots=True)
class ZchConfig:
    """How managed-collision tables (``--categorical_ids zch``) give rows to ids."""

    zch_eviction_policy: str = option(
        "lfu",
        "--categorical_ids zch: which ids keep their rows when new ones come (TorchRec's MCH eviction "
        "policies). lfu: the most seen since they got a row; lru: the most recently seen; "
        "distance_lfu: counts divided by the steps since last seen (for ids whose popularity drifts).",
        choices=tuple(EVICTION_POLICIES),
    )
    zch_eviction_interval: int = option(
        1,
        "--categorical_ids zch: training steps between two evictions, when the ids counted since "
        "the last take rows. Longer counts rare ids more fairly but leaves new ids on the shared "
        "row longer; --checkpoint_every must be a multiple (the counts between two evictions are "
        "not part of TorchRec's saved state, so a checkpoint must fall right after one).",
    )

    def check(self) -> None:
        require_positive("zch_eviction_interval", self.zch_eviction_interval)


def check_zch(cfg: ZchConfig, table_sizes: Sequence[int], launch: LaunchConfig, checkpoint: CheckpointConfig) -> None:
    """Refuses, naming the option, what managed-collision tables cannot train with: tables too
    small for TorchRec's module, a sharding type its sharder does not offer, checkpoints that
    would not fall right after an eviction."""
    cfg.check()
    for i, rows in enumerate(table_sizes):
        if rows < MIN_ROWS_PER_RANK:
            raise ConfigError(
                f"--num_embeddings {rows} (table {i}) is too small for --categorical_ids zch: TorchRec's "
                f"managed-collision table keeps its last row for ids without one, so it needs at least "
                f"{MIN_ROWS_PER_RANK} rows per rank"
            )
    if launch.sharding_type not in ("auto", *SHARDING_TYPES):
        raise ConfigError(
            f"--sharding_type {launch.sharding_type}: TorchRec shards managed-collision tables "
            f"(--categorical_ids zch) {' or '.join(SHARDING_TYPES)} only; use --sharding_type "
            f"{SHARDING_TYPES[0]} or auto"
        )
    every, interval = checkpoint.checkpoint_every, cfg.zch_eviction_interval
    if checkpoint.checkpoint_dir and every % interval:
        raise ConfigError(
            f"--checkpoint_every {every} is not a multiple of --zch_eviction_interval {interval}: a "
            "checkpoint must fall right after an eviction (TorchRec saves no ids counted since the "
            "last), so that a resumed run trains as an uninterrupted one"
        )


def check_world_size(table_sizes: Sequence[int], world_size: int) -> None:
    """Refuses a world whose row-wise shares (TorchRec's: ceil(rows / ranks) each, the last rank
    the rest) leave a rank fewer rows than a managed-collision share needs, or that TorchRec's
    planner cannot split the modules over (:data:`PLANNER_BUCKETS`)."""
    if PLANNER_BUCKETS % world_size:
        raise ConfigError(
            f"{world_size} ranks: TorchRec's planner splits managed-collision tables (--categorical_ids zch) "
            f"over world sizes that divide {PLANNER_BUCKETS:,} (up to 16 ranks, and those times a power of "
            "two up to 256); use such a number of ranks"
        )
    for i, rows in enumerate(table_sizes):
        share = -(-rows // world_size)
        last = rows - share * (world_size - 1)
        if min(share, last) < MIN_ROWS_PER_RANK:
            raise ConfigError(
                f"--num_embeddings {rows} (table {i}) on {world_size} ranks leaves a rank {min(share, last)} "
                f"rows: a managed-collision table (--categorical_ids zch) needs {MIN_ROWS_PER_RANK} per rank; "
                f"give at least {MIN_ROWS_PER_RANK * world_size} rows, or fewer ranks"
            )


def check_resharding(saved_world_size: int, world_size: int, where: str) -> None:
    """Refuses loading a checkpoint's managed-collision state into ranks it cannot be split over:
    each of ``world_size`` ranks must take whole shares of the ``saved_world_size`` that wrote it."""
    if saved_world_size % world_size:
        raise ConfigError(
            f"{where} holds managed-collision tables (--categorical_ids zch) written by {saved_world_size} "
            f"rank(s): their id-to-row state is split by id range per rank and merges only into a world "
            f"size that divides {saved_world_size}, not {world_size}; run it on {saved_world_size} rank(s) "
            "or a divisor of that"
        )


def settle_loaded_state(model: nn.Module) -> None:
    """Does for every MCH module of ``model`` what TorchRec's hook does after ``load_state_dict``,
    which DCP's in-place load skips: checks that the module's share of rows is made of whole shares
    of the world that saved it, and sorts its ids (merged shares arrive one after the other, each
    sorted alone; the module's lookup is a binary search)."""
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
            ids = module._mch_sorted_raw_ids
            table = module._name or ""
            counts[table] = counts.get(table, 0) + int((ids != torch.iinfo(torch.int64).max).sum())
    return counts


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
