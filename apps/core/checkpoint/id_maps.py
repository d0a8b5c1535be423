"""Managed-collision tables' state (:mod:`apps.core.zch`) carried to a world size that does not
divide the one that wrote it: a 1-rank checkpoint resumed on 2 ranks, 2 on 4 or 3, 3 on 2.

How TorchRec shares a table out (torchrec 1.6-1.8). Row-wise, the i-th share of rows (by row
offset) is rank i's, and TorchRec's input dist sends each id of ``[0, input_size)`` to the rank
of block ``id // ceil(input_size / world_size)`` (FBGEMM's ``block_bucketize_sparse_features``
with one block per rank), so rank i's MCH module holds the ids of the i-th block: its sorted ids
(``_mch_sorted_raw_ids``, empty slots the int64 maximum), each one's row (``_mch_remapped_ids_mapping``,
global rows of its share) and its eviction policy's metadata per slot (``_mch_counts``,
``_mch_last_access_iter``); its share's last row is the default row of every id of its block
without one, and its last slot is never given to an id.

Where the world size divides the saved one, DCP merges whole shares and TorchRec's
``validate_state`` sorts them (the checkpointer's plain load). Otherwise a new rank's block cuts
across the saved ones, and this rebuilds each rank's share as it would hold it had it trained on
this world size: it reads the saved shares whose blocks overlap its own (of the id maps, the
weights and the optimizer's row states: when splitting, the whole of one or two saved shares),
keeps the saved ids of its block, and, where more of them than its rows less the default row,
those its eviction policy ranks highest (lfu: counts; lru: last step seen; distance_lfu: counts
over the steps since last seen, as TorchRec scores them at an eviction; the others lose their
rows as an eviction takes them). Each kept id takes the next row of the share in id order,
with its weight row and optimizer state row exactly; the default row is the saved default row of
the saved block that holds most of the new one: exactly the default row its ids had where the
world grows by a multiple (1 to 2, 2 to 4: each new block lies in one saved block; 3 to 6: but for
an id or two at its edge, where the range does not divide evenly), and where it does not (2 to 3),
a trained default row of one of the two saved blocks it straddles (a blend of them would be
neither). The unused rows are zero: nothing looks them up, and the row an eviction
gives an id is reset first.
"""

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

from apps.core.checkpoint.reshard import SavedPieces, below, parse_key
from apps.core.checkpoint.storage.errors import CheckpointError
from apps.core.common.tables import Tables

logger = logging.getLogger(__name__)

#: An empty slot of an id map (TorchRec's ``torch.iinfo(torch.int64).max``).
NO_ID = torch.iinfo(torch.int64).max
#: The buffers of an MCH module's state: its sorted ids, their rows; the rest (``_mch_*``) are its
#: eviction policy's metadata per slot.
IDS, ROWS = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"
#: The module's record of the shares it was built of, which its loaded state is checked against
#: (``validate_state``): the live one, which says this world's shares.
SEGMENTS = "_output_segments_tensor"
#: What the key of a managed-collision module's buffer in a model's state dict is made of.
MODULES = "._managed_collision_modules."


def splits(saved_world_size: int, world_size: int) -> bool:
    """Whether a checkpoint of ``saved_world_size`` ranks needs :class:`IdMapSplit` on
    ``world_size`` (else DCP's load of whole shares, merged by TorchRec, does it)."""
    return saved_world_size % world_size != 0


def blocks(input_size: int, shares: int) -> list[tuple[int, int]]:
    """The ids each of ``shares`` ranks takes, as TorchRec's row-wise input dist sends them:
    ``[start, end)`` of the i-th block of ``ceil(input_size / shares)`` ids."""
    size = -(-input_size // shares)
    return [(i * size, min((i + 1) * size, input_size)) for i in range(shares)]


def keep_scores(policy: MCHEvictionPolicy, metadata: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """How TorchRec's eviction ``policy`` ranks ids holding rows at step ``step`` (the higher,
    the surer to keep its row), from their ``metadata`` (the policy's, by name: counts,
    last_access_iter)."""
    if isinstance(policy, LFU_EvictionPolicy):
        return metadata["counts"].double()
    since = (step - metadata["last_access_iter"] + 1).double()
    if isinstance(policy, LRU_EvictionPolicy):
        return -since
    if isinstance(policy, DistanceLFU_EvictionPolicy):
        return metadata["counts"].double() / since.pow(policy._decay_exponent)
    raise CheckpointError(f"managed-collision eviction policy {type(policy).__name__}: not one this version splits")


def kept(ids: torch.Tensor, scores: torch.Tensor, room: int) -> torch.Tensor:
    """The positions of the ``ids`` that keep a row among ``room`` rows: all where they fit,
    else the ``room`` of the highest ``scores`` (of equal scores, the first); in increasing
    order of id (an id map is sorted)."""
    chosen = torch.arange(len(ids))
    if len(ids) > room:
        chosen = torch.argsort(scores, descending=True, stable=True)[:room]
    return chosen[torch.argsort(ids[chosen])]


@dataclass(frozen=True)
class _Share:
    """Rows ``[offset, offset + size)`` of a table: one rank's share."""

    offset: int
    size: int


def _shares(pieces: Any) -> list[_Share]:
    """The shares of a row-wise tensor's pieces (offsets, sizes), by row offset."""
    return sorted({_Share(int(offsets[0]), int(sizes[0])) for offsets, sizes in pieces}, key=lambda s: s.offset)


class _TableSplit:
    """One managed-collision table: the saved shares this rank reads (:attr:`pieces`, what DCP
    loads) and its own share rebuilt of them (:meth:`apply`)."""

    def __init__(
        self,
        module: MCHManagedCollisionModule,
        live: dict[str, ShardedTensor],
        saved: dict[str, TensorStorageMetadata],
        saved_world_size: int,
    ) -> None:
        self.module, self.name = module, module._name or ""
        self.live = {key: _local(key, tensor) for key, tensor in live.items()}
        self.ids_key = next(key for key in live if key.endswith(f".{IDS}"))
        self.rows_key = next(key for key in live if key.endswith(f".{ROWS}"))
        self.metadata_keys = [key for key in live if "._mch_" in key and key not in (self.ids_key, self.rows_key)]
        self.saved_shares = _shares((c.offsets, c.sizes) for c in saved[self.ids_key].chunks)
        if len(self.saved_shares) != saved_world_size:
            raise CheckpointError(
                f"the checkpoint's managed-collision table {self.name} has {len(self.saved_shares)} shares, not one "
                f"per rank of the {saved_world_size} that wrote it (TorchRec's row-wise layout); evaluate or resume it "
                f"on {saved_world_size} rank(s)"
            )
        shares = _shares((s.shard_offsets, s.shard_sizes) for s in live[self.ids_key].metadata().shards_metadata)
        (local,) = live[self.ids_key].local_shards()
        self.share = _Share(int(local.metadata.shard_offsets[0]), int(local.metadata.shard_sizes[0]))
        self.block = blocks(module.input_size(), len(shares))[shares.index(self.share)]
        overlaps = [
            min(end, self.block[1]) - max(start, self.block[0])
            for start, end in blocks(module.input_size(), saved_world_size)
        ]
        self.read = [s for s, overlap in enumerate(overlaps) if overlap > 0]
        self.default = max(self.read, key=lambda s: overlaps[s])  # the first of the largest
        # key -> saved share -> the buffer DCP reads it into
        self.buffers = {
            key: {
                s: torch.empty((self.saved_shares[s].size, *md.size[1:]), dtype=md.properties.dtype) for s in self.read
            }
            for key, md in saved.items()
        }
        self.pieces = {
            key: SavedPieces(
                saved[key].size,
                saved[key].properties.dtype,
                {(self.saved_shares[s].offset, *(0 for _ in saved[key].size[1:])): b for s, b in buffers.items()},
            )
            for key, buffers in self.buffers.items()
        }

    @torch.no_grad()
    def apply(self) -> None:
        """Writes this rank's share of the table (its id map, the policy's metadata, the weight
        rows and optimizer states) from the saved shares read."""
        ids, share, row, metadata = self._saved_ids()
        keep = self._keep(ids, metadata)
        new_ids = torch.full((self.share.size,), NO_ID)
        new_ids[: len(keep)] = ids[keep]
        self.live[self.ids_key].copy_(new_ids)
        self.live[self.rows_key].copy_(torch.arange(self.share.offset, self.share.offset + self.share.size))
        # the saved default row (and slot: its metadata) is its share's last
        default = self.saved_shares[self.default].size - 1
        for key in self.metadata_keys:
            values = metadata[key].new_zeros(self.share.size)
            values[: len(keep)] = metadata[key][keep]
            values[-1] = self.buffers[key][self.default][default]
            self.live[key].copy_(values)
        for key in self.live.keys() - {self.ids_key, self.rows_key, *self.metadata_keys}:  # weight, optimizer states
            saved = self.buffers[key]
            rows = saved[self.default].new_zeros((self.share.size, *saved[self.default].shape[1:]))
            for s in self.read:
                moved = (share[keep] == s).nonzero().view(-1)
                rows[moved] = saved[s][row[keep[moved]]]  # the i-th kept id's row is the share's i-th
            rows[-1] = saved[self.default][default]
            self.live[key].copy_(rows)  # built on the host: the live share may be on a GPU

    def _saved_ids(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Every slot of the saved shares read: its id, its saved share and row in that share, and
        its policy metadata (by key)."""
        rows = {s: self.buffers[self.rows_key][s] - self.saved_shares[s].offset for s in self.read}
        if any(((r < 0) | (r >= self.saved_shares[s].size)).any() for s, r in rows.items()):
            raise CheckpointError(
                f"the checkpoint's managed-collision table {self.name} maps ids to rows outside their rank's share "
                "(not TorchRec's row-wise layout); evaluate or resume it on the ranks that wrote it"
            )
        ids = torch.cat([self.buffers[self.ids_key][s] for s in self.read])
        share = torch.cat([torch.full_like(rows[s], s) for s in self.read])
        metadata = {key: torch.cat([self.buffers[key][s] for s in self.read]) for key in self.metadata_keys}
        return ids, share, torch.cat([rows[s] for s in self.read]), metadata

    def _keep(self, ids: torch.Tensor, metadata: dict[str, torch.Tensor]) -> torch.Tensor:
        """The positions of the saved ids that keep a row in this rank's share, by id: those of its
        block, as many as it has rows for (less the default row), as its eviction policy ranks them."""
        mine = ((ids != NO_ID) & (ids >= self.block[0]) & (ids < self.block[1])).nonzero().view(-1)
        room = self.share.size - 1
        if len(mine) > room:
            logger.warning(
                "table %s: %d of the checkpoint's ids fall in the id range of this rank's share of %d rows, which has "
                "room for %d: the %d its eviction policy ranks lowest lose their rows (docs/data.md)",
                self.name, len(mine), self.share.size, room, len(mine) - room,
            )  # fmt: skip
        step = int(self.module._current_iter_tensor.item())
        policy_metadata = {key.rsplit("._mch_", 1)[1]: values[mine] for key, values in metadata.items()}
        return mine[kept(ids[mine], keep_scores(self.module._eviction_policy, policy_metadata, step), room)]


def _local(key: str, tensor: Any) -> torch.Tensor:
    """This rank's one share of the row-wise sharded ``tensor``, in place."""
    if not isinstance(tensor, ShardedTensor) or len(tensor.local_shards()) != 1:
        raise CheckpointError(
            f"{key}: a managed-collision table's state is one row-wise share per rank here; it is not"
        )
    return tensor.local_shards()[0].tensor


class IdMapSplit:
    """Collective use. Loads the managed-collision tables of ``model`` from a checkpoint of
    ``saved_world_size`` ranks that this world size does not divide (:func:`splits`).

    Built from what the checkpointer would load (``destinations``: its entries, the ``model``'s
    live state dict and the ``optimizer``'s destinations, where these tables' states are their
    live tensors), and the checkpoint's ``saved`` metadata. :attr:`destinations` is what to load
    instead: these tables' entries redirected to the saved shares each rank needs; after that
    load, :meth:`apply` rebuilds each rank's share of them (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        destinations: dict[str, Any],
        saved: Metadata,
        tables: Tables,
        saved_world_size: int,
    ) -> None:
        modules = {m._name: m for m in model.modules() if isinstance(m, MCHManagedCollisionModule)}
        state, optimizer = dict(destinations["model"]), dict(destinations["optimizer"])
        saved_entries = {**below(saved, "model"), **below(saved, "optimizer")}
        self.tables: list[_TableSplit] = []
        for name, module in modules.items():
            live = {key: value for key, value in state.items() if f"{MODULES}{name}._mch_" in key}
            weight = tables.weight_key(name or "")
            live[weight] = state[weight]
            states = {
                key: value for key, value in optimizer.items() if (k := parse_key(key, tables)) and k.table == name
            }
            missing = sorted({**live, **states}.keys() - saved_entries.keys())
            if missing:
                raise CheckpointError(
                    f"the checkpoint holds no {', '.join(missing)} of managed-collision table {name}: it was not "
                    "written by this model. Resume with the options it was written with"
                )
            table = _TableSplit(
                module, {**live, **states}, {key: saved_entries[key] for key in (*live, *states)}, saved_world_size
            )
            self.tables.append(table)
            for key in live:
                state[key] = table.pieces[key]
            for key in states:
                optimizer[key] = table.pieces[key]
            for key in [key for key in state if key.endswith(f"{MODULES}{name}.{SEGMENTS}")]:
                del state[key]  # this world's shares, not the saved one's
        self.destinations = {**destinations, "model": state, "optimizer": optimizer}
        self.saved_world_size = saved_world_size

    def apply(self) -> None:
        """Rebuilds each managed-collision table's share, once DCP has loaded :attr:`destinations`."""
        for table in self.tables:
            table.apply()
        logger.info(
            "managed-collision tables %s: each rank took the ids of its id range from the %d saved rank(s)' shares, "
            "with their rows and optimizer state (docs/data.md)",
            ", ".join(table.name for table in self.tables),
            self.saved_world_size,
        )
