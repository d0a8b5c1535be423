"""The embedding tables' optimizer state, carried from the sharding a checkpoint was saved with to
the sharding a run resumes with: any sharding type to any other, on any world size.

Weights need nothing of this: under every sharding type a table's weight is one (rows, dim)
tensor of one name, and DCP reads each rank the rows and columns it holds now. Optimizer states
are laid out per sharding type (TorchRec 1.6-1.8, FBGEMM 1.6-1.8):

- A fused table (table_wise, row_wise, table_row_wise, column_wise, table_column_wise) keeps
  FBGEMM's states as ``state.fused.<param>.<table>.<name>``, TorchRec naming FBGEMM's first state
  ``momentum1``:

  - a per-element state (adagrad's sum of squared gradients, adam's ``momentum1`` and
    ``exp_avg_sq``) is a (rows, dim) tensor sharded like the weight: the same tensor whatever
    the sharding, which DCP reshards by itself;
  - a row-wise state (rowwise_adagrad's ``momentum1``) is one value per row *per column shard*:
    FBGEMM adds to it, each step, the mean of the squared gradients over the shard's own columns.
    TorchRec lays a table split into k column shards out as one 1-D tensor of k blocks of
    ``rows`` values, in column order (k = 1 unless the table is split by columns).

- A data-parallel table is a plain replicated weight, and its state that of the dense
  optimizer group ``data_parallel_tables`` under torch's names,
  ``state.dense.data_parallel_tables.<param>.<name>``: ``sum`` ((rows, 1) for TorchRec's
  unfused RowWiseAdagrad, the row mean as above; (rows, dim) for Adagrad), ``exp_avg`` and
  ``exp_avg_sq`` for Adam, and ``step``.

A state saved under the name and shape it has now (and, row-wise, the same column blocks) loads
as it is. A per-element state of another name is read by DCP straight into its tensor. A row-wise
state of another layout is read in its saved layout, each rank reading only the rows it holds now
(its column blocks of them), and converted: each column block gets the mean of the saved blocks'
values weighted by the columns they share with it. That is exact where each block is a union of
saved ones (column shards merged: a row's mean over all columns is its shards' means weighted by
their widths) and the best estimate where a saved block is split (each new column shard gets the
mean of the saved block it lies in: its own mean was never saved). A data-parallel table's
``step`` from a fused table is the checkpoint's step: one optimizer step per training step.
"""

from dataclasses import dataclass
from typing import Any, Iterable, NoReturn, Sequence

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from apps.core.checkpoint.storage.errors import CheckpointError
from apps.core.common.tables import Tables

#: Per embedding optimizer: each fused (FBGEMM) state of a table -> the same state of a
#: data-parallel table's torch optimizer. SGD keeps no state.
DATA_PARALLEL_NAMES = {
    "rowwise_adagrad": {"momentum1": "sum"},
    "adagrad": {"momentum1": "sum"},
    "adam": {"momentum1": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "sgd": {},
}
#: A data-parallel table's count of optimizer steps, which a fused table does not keep.
STEP = "step"

#: A table's column blocks: (first column, width) of each column shard, in column order.
Blocks = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StateKey:
    """What a key of an optimizer's state dict names: a state of a table's optimizer, fused
    (FBGEMM's, named ``<table>.<name>`` by TorchRec) or a data-parallel table's (torch's)."""

    table: str
    name: str
    fused: bool


def parse_key(key: str, tables: Tables) -> StateKey | None:
    """The state of a table of ``tables`` that ``key`` (of a flattened optimizer state dict) is,
    or None (an MLP's)."""
    match = tables.match_state_key(key)
    if match is None:
        return None
    table, state = match["table"], match["state"]
    fused = state.startswith(f"{table}.")
    return StateKey(table, state.removeprefix(f"{table}."), fused)


def _blocks(chunks: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Blocks:
    """The column blocks of a weight split into pieces of these (offsets, sizes)."""
    return tuple(sorted({(offsets[1], sizes[1]) for offsets, sizes in chunks}))


def current_blocks(weight: torch.Tensor) -> Blocks:
    """The column blocks of a table's weight as this run holds it (a plain tensor: one block)."""
    if isinstance(weight, ShardedTensor):
        return _blocks((s.shard_offsets, s.shard_sizes) for s in weight.metadata().shards_metadata)
    return ((0, weight.shape[1]),)


def saved_blocks(weight: TensorStorageMetadata) -> Blocks:
    """The column blocks of a table's weight as the checkpoint holds it (its saved pieces)."""
    return _blocks((chunk.offsets, chunk.sizes) for chunk in weight.chunks)


@dataclass(frozen=True)
class ColumnMap:
    """Where each current column block's row-wise state comes from: per current block, each saved
    block it overlaps and the number of columns they share. ``exact`` when every current block
    is a union of saved blocks (then their weighted mean is its exact state)."""

    sources: tuple[tuple[tuple[int, int], ...], ...]
    exact: bool


def column_map(saved: Blocks, current: Blocks) -> ColumnMap:
    """Where the row-wise state of each of the ``current`` column blocks comes from."""
    sources = tuple(
        tuple(
            (i, shared)
            for i, (first, width) in enumerate(saved)
            if (shared := min(start + size, first + width) - max(start, first)) > 0
        )
        for start, size in current
    )
    return ColumnMap(sources, all(shared == saved[i][1] for block in sources for i, shared in block))


class SavedPieces(torch.Tensor):
    """Where DCP loads pieces of a saved tensor that nothing here holds in its saved layout: a
    tensor of the saved global size that only lists the pieces this rank reads, as
    ``{offsets: buffer}`` (DCP's ``__create_chunk_list__``/``__get_tensor_shard__`` protocol, as
    DTensor's). Any other use raises: it has no storage of its own."""

    pieces: dict[tuple[int, ...], torch.Tensor]

    @staticmethod
    def __new__(
        cls, size: torch.Size, dtype: torch.dtype, pieces: dict[tuple[int, ...], torch.Tensor]
    ) -> "SavedPieces":
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype)
        self.pieces = pieces
        return self

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None, f"DCP addresses the pieces of {index.fqn} by their offsets"
        return self.pieces[tuple(index.offset)]

    # torch types Tensor.__torch_dispatch__ as the plain function it disables dispatch with, not as
    # the classmethod its subclasses define (torch's documented form, this one).
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> NoReturn:
        raise TypeError(f"{cls.__name__} is only a checkpoint load destination; {func} is not supported")


def _rowwise_pieces(state: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(position in the row-wise layout, 1-D view) of each piece of ``state`` this rank holds."""
    if isinstance(state, ShardedTensor):
        return [(shard.metadata.shard_offsets[0], shard.tensor.view(-1)) for shard in state.local_shards()]
    return [(0, state.view(-1))]  # a data-parallel table's (rows, 1)


@dataclass
class _RowwiseConversion:
    """One row-wise state: each piece this rank holds (a view of the live state) and the read
    buffers of the saved pieces it is the column-weighted mean of, with their weights."""

    targets: list[tuple[torch.Tensor, list[tuple[torch.Tensor, float]]]]

    def apply(self) -> None:
        for target, sources in self.targets:
            zero = torch.zeros((), dtype=torch.float64)  # sum's start: a tensor rather than the int 0
            mean = sum((weight * buffer.view(-1).double() for buffer, weight in sources), zero)
            target.copy_(mean)


def _rowwise(
    table: str,
    saved_key: str,
    saved: TensorStorageMetadata,
    saved_columns: Blocks,
    state: torch.Tensor,
    columns: Blocks,
    rows: int,
) -> tuple[SavedPieces, _RowwiseConversion, bool]:
    """The pieces of the saved row-wise state ``saved`` that this rank's pieces of ``state`` need,
    their conversion, and whether it is exact."""
    tail = tuple(saved.size[1:])  # () for FBGEMM's blocks, (1,) for RowWiseAdagrad's (rows, 1)
    if saved.size[0] != len(saved_columns) * rows or tail not in ((), (1,)):
        raise CheckpointError(
            f"checkpoint entry optimizer.{saved_key} is {tuple(saved.size)}, not the row-wise state of "
            f"{table} ({rows} rows in {len(saved_columns)} column blocks): a layout this version does "
            "not know. Resume with the sharding and versions it was written with"
        )
    mapping = column_map(saved_columns, columns)
    buffers: dict[int, torch.Tensor] = {}  # saved position -> buffer, read once for all targets
    targets = []
    for position, target in _rowwise_pieces(state):
        block, first = divmod(position, rows)
        sources = []
        for saved_block, shared in mapping.sources[block]:
            start = saved_block * rows + first
            if start not in buffers:
                buffers[start] = torch.empty((target.numel(), *tail), dtype=saved.properties.dtype)
            sources.append((buffers[start], shared / columns[block][1]))
        targets.append((target, sources))
    pieces = {(start, *(0 for _ in tail)): buffer for start, buffer in buffers.items()}
    return SavedPieces(saved.size, saved.properties.dtype, pieces), _RowwiseConversion(targets), mapping.exact


class Resharding:
    """Collective use. Loads the optimizer state of a checkpoint saved under any sharding.

    Built from the optimizer's live state dict, the sharded model's (for each table's size and
    column blocks now; ``tables`` says which of its entries are the tables') and the checkpoint's metadata below its ``optimizer`` and ``model``
    entries (:func:`below`). :attr:`destinations` is what DCP loads the ``optimizer`` entry
    into: the live state tensors under the keys they were saved as, and :class:`SavedPieces`
    for states to convert; after that load, :meth:`apply` writes the converted states into the
    live ones. :attr:`converted` says, per table whose state changed name or layout, whether
    it is exactly the saved state (else the estimate described above).
    """

    def __init__(
        self,
        optimizer_state: dict[str, Any],
        saved_optimizer: dict[str, Any],
        model_state: dict[str, Any],
        saved_model: dict[str, Any],
        tables: Tables,
        embedding_optimizer: str,
        step: int,
    ) -> None:
        self.saved, self.saved_model, self.model_state = saved_optimizer, saved_model, model_state
        self.tables, self.names, self.step = tables, DATA_PARALLEL_NAMES[embedding_optimizer], step
        self.saved_tables = _table_states(saved_optimizer, tables)
        self.destinations: dict[str, Any] = {}
        self.converted: dict[str, bool] = {}
        self._conversions: list[_RowwiseConversion] = []
        self._steps: list[torch.Tensor] = []
        live, _ = flatten_state_dict(optimizer_state)
        for key, value in live.items():
            state = parse_key(key, tables)
            if state is None:
                self.destinations[key] = value  # an MLP's state: the same under every sharding
            else:
                self._add(state, key, value)

    def _add(self, state: StateKey, key: str, value: torch.Tensor) -> None:
        saved_key = self._saved_key(state)
        if saved_key is None:  # a data-parallel table's step, from a fused one
            self._steps.append(value)
            self._mark(state.table, exact=True)
            return
        saved, weight = self.saved[saved_key], self.model_state[self.tables.weight_key(state.table)]
        rows, dim = weight.size()
        if tuple(saved.size) == (rows, dim):  # per-element: the same tensor, maybe renamed
            self.destinations[saved_key] = value
            if saved_key != key:
                self._mark(state.table, exact=True)
            return
        columns, saved_columns = (
            current_blocks(weight),
            saved_blocks(self.saved_model[self.tables.weight_key(state.table)]),
        )
        if saved_key == key and saved.size == value.size() and saved_columns == columns:
            self.destinations[key] = value
            return
        pieces, conversion, exact = _rowwise(state.table, saved_key, saved, saved_columns, value, columns, rows)
        self.destinations[saved_key] = pieces
        self._conversions.append(conversion)
        self._mark(state.table, exact)

    def _mark(self, table: str, exact: bool) -> None:
        self.converted[table] = self.converted.get(table, True) and exact

    def _saved_key(self, state: StateKey) -> str | None:
        """The key of the saved state that ``state`` loads from; None for a data-parallel
        table's step where the checkpoint's table was fused."""
        saved = self.saved_tables.get(state.table, {})
        was_fused = next(iter(saved.values()))[1] if saved else state.fused
        name: str | None
        if was_fused == state.fused:
            name = state.name
        elif state.fused:  # data-parallel then, fused now
            name = self.names.get(state.name)
        else:  # fused then, data-parallel now
            name = {dp: fused for fused, dp in self.names.items()}.get(state.name)
            if name is None and state.name == STEP:
                return None
        if name is None or name not in saved:
            raise CheckpointError(
                f"the checkpoint holds no {name or state.name} optimizer state for table {state.table} "
                f"(it has {', '.join(sorted(saved)) or 'none'}): it was not written by this model's "
                "optimizer. Resume with the options it was written with, or use a new --checkpoint_dir"
            )
        return saved[name][0]

    def apply(self) -> None:
        """Writes the converted states into the live ones, once DCP has loaded :attr:`destinations`."""
        for conversion in self._conversions:
            conversion.apply()
        for step in self._steps:
            step.fill_(self.step)


def below(metadata: Metadata, entry: str) -> dict[str, Any]:
    """The storage metadata of the checkpoint's keys below ``entry``, by their key there."""
    prefix = f"{entry}."
    return {key[len(prefix) :]: md for key, md in metadata.state_dict_metadata.items() if key.startswith(prefix)}


def _table_states(saved_optimizer: dict[str, Any], tables: Tables) -> dict[str, dict[str, tuple[str, bool]]]:
    """Per table, each saved optimizer state: name -> (key, whether fused)."""
    states: dict[str, dict[str, tuple[str, bool]]] = {}
    for key in saved_optimizer:
        state = parse_key(key, tables)
        if state is not None:
            states.setdefault(state.table, {})[state.name] = (key, state.fused)
    return states
