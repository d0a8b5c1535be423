"""Criteo click logs, preprocessed (``python -m apps.dlrm.preprocess``), as TorchRec batches.

The days of the folder (layout: :mod:`apps.dlrm.data.criteo.layout`) are memory-mapped and read as
one sequence of rows, in day order. The last ``--eval_days`` days are held out MLPerf style:
of their last ``--eval_fraction`` of rows, the first half (rounded up) is the validation split
and the rest the test split; every row before them trains.

Training. With ``W`` ranks and ``--batch_size B``, a step consumes a global batch of ``G = B * W``
rows of the epoch's row order, and rank ``r`` takes its ``r``-th slice of ``B`` rows, so ranks
never overlap. An epoch is ``floor(train rows / G)`` steps; the rows left over are not lost, as
the order changes every epoch. With ``--shuffle`` (the default) the epoch's order is the training
rows cut into blocks of ``--shuffle_block_rows`` consecutive rows, the blocks permuted by a
generator seeded with ``(--seed, epoch)``; without, it is the file order. A batch is therefore a
pure function of (seed, step, rank): resuming at step ``s`` yields exactly the batches an
uninterrupted run yields from step ``s``.

Evaluation. ``eval_batches(split, n)`` walks the split in order, ``G`` rows per global batch,
rank ``r`` taking its slice. ``n = 0`` means the whole split: the rows after the last full
global batch form one more, smaller batch, split as evenly as possible over the ranks (at most
``W - 1`` rows, fewer than one per rank, are left out). A larger ``n`` than the split holds is
capped at the whole split. Every rank gets the same number of batches, as the sharded model's
collectives require.

Multi-hot (``--multi_hot_sizes``): each one-hot id becomes that many ids by MLPerf DLRMv2's fixed
lookup tables (:mod:`apps.dlrm.data.criteo.multi_hot`), drawn once when the loader starts (refused
first, with the figures, where this host's training processes cannot all hold them), so the
preprocessed one-hot folder trains as MLPerf's multi-hot Criteo.

Batches are assembled with numpy slice copies (a few per batch, never a loop over rows) into
tensors that are pinned when training on a GPU, by a background thread that keeps a few batches
ready, so the training loop does not wait on page faults or disk reads.
"""

import itertools
import logging
import math
from typing import Any, Generator, Iterator, Protocol

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from apps.core.common.errors import ConfigError
from apps.core.common.splits import Range, held_out_split
from apps.core.data import RankShare
from apps.dlrm.data.criteo.layout import DayArrays, check_table_sizes, open_folder
from apps.dlrm.data.criteo.multi_hot import check_host_memory, expand, multi_hot_tables
from apps.dlrm.data.criteo.tables import CAT_FEATURES, INT_FEATURES, feature_names
from apps.dlrm.data.kjt_layout import FixedLayout
from apps.dlrm.data.prefetch import prefetched

logger = logging.getLogger("apps.dlrm.data")

PREFETCH_THREAD = "criteo-prefetch"


class TableSizes(Protocol):
    """What the loader reads of the model section (``apps.dlrm.config.ModelConfig``). Typed by
    what it reads, not by that class: the configuration imports this room (the Criteo features
    and table presets), so this room does not import it back."""

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each table: the folder's ids must fit them."""
        ...

    @property
    def ids_per_feature(self) -> list[int]:
        """Ids per sample of each feature: more than one is multi-hot."""
        ...


class RowOrder(Protocol):
    """What the loader reads of the data section (``apps.dlrm.config.DataConfig``): which rows
    are held out, and how the training rows are shuffled."""

    eval_days: int
    eval_fraction: float
    shuffle: bool
    shuffle_block_rows: int


class CriteoClickLogs:
    """The batches of a preprocessed Criteo folder that ``share`` says this rank reads;
    ``local_world_size``: the training processes on this host, each of which holds the
    multi-hot tables."""

    #: A preprocessed folder's columns are fixed (see :class:`~apps.dlrm.data.ClickLogs`).
    columns: dict[str, Any] | None = None

    def __init__(
        self,
        model: TableSizes,
        data: RowOrder,
        share: RankShare,
        folder: str,
        pin_memory: bool,
        local_world_size: int = 1,
    ) -> None:
        self.data, self.share = data, share
        self.pin_memory = pin_memory
        self.keys = feature_names(CAT_FEATURES)
        manifest, self.days = open_folder(folder)
        check_table_sizes(manifest["num_embeddings_per_feature"], model.table_sizes, folder)
        self._day_starts = np.cumsum([0] + [day.rows for day in self.days])
        self.splits = held_out_split([day.rows for day in self.days], data.eval_days, data.eval_fraction, folder)
        train_rows = self.splits["train"][1]
        self.steps_per_epoch = train_rows // share.global_batch
        if not self.steps_per_epoch:
            raise ConfigError(
                f"{folder} has {train_rows} training rows, fewer than one global batch "
                f"(--batch_size {share.batch_size} x {share.world_size} ranks): lower --batch_size"
            )
        self._block_rows = data.shuffle_block_rows if data.shuffle else train_rows
        self._kjt_layouts: dict[int, FixedLayout] = {}
        self._ids_per_feature = model.ids_per_feature
        self._multi_hot = None
        if max(self._ids_per_feature) > 1:
            check_host_memory(self._ids_per_feature, model.table_sizes, local_world_size)
            logger.info(
                "criteo: drawing MLPerf's multi-hot lookup tables (%s ids per sample)", sum(self._ids_per_feature)
            )
            self._multi_hot = multi_hot_tables(self._ids_per_feature, model.table_sizes)
        logger.info(
            "criteo %s: %d days, %s rows: train %s (%d steps per epoch), validation %s, test %s",
            folder,
            len(self.days),
            f"{int(self._day_starts[-1]):,}",
            f"{train_rows:,}",
            self.steps_per_epoch,
            *(f"{stop - start:,}" for start, stop in (self.splits["val"], self.splits["test"])),
        )

    # --- iteration -----------------------------------------------------------------------------

    def teacher(self) -> None:
        """Real labels have no hidden teacher to compare with (no AUROC ceiling)."""
        return None

    def train_batches(self, start_step: int = 0) -> Generator[Batch, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        order = _EpochOrder(self.splits["train"][1], self._block_rows, self.share.seed, self.data.shuffle)
        return prefetched(
            lambda step: self._batch(order.ranges(*self._train_slice(step))),
            itertools.count(start_step),
            PREFETCH_THREAD,
        )

    def eval_batches(self, split: str, num_batches: int) -> Generator[Batch, None, None]:
        """This rank's batches of ``split`` ("val" or "test"); ``num_batches`` 0: all of it."""
        ranges = self._eval_ranges(split, num_batches)
        return prefetched(lambda i: self._batch([ranges[i]]), range(len(ranges)), PREFETCH_THREAD)

    def _train_slice(self, step: int) -> tuple[int, int, int]:
        """(epoch, first, last) positions of this rank's rows of ``step`` in the epoch's order."""
        epoch, index = divmod(step, self.steps_per_epoch)
        first = self.share.block(index) * self.share.batch_size
        return epoch, first, first + self.share.batch_size

    def _eval_ranges(self, split: str, num_batches: int) -> list[Range]:
        start, stop = self.splits[split]
        share = self.share
        b, w = share.batch_size, share.world_size
        full, rest = divmod(stop - start, share.global_batch)
        firsts = [start + share.block(i) * b for i in range(full)]
        ranges = [(first, first + b) for first in firsts]
        if rest >= w:  # the tail: rest // w or rest // w + 1 rows per rank
            sizes = [rest // w + (r < rest % w) for r in range(w)]
            first = start + full * share.global_batch + sum(sizes[: share.rank])
            ranges.append((first, first + sizes[share.rank]))
        if num_batches:
            ranges = ranges[:num_batches]
        return ranges

    # --- batch assembly ------------------------------------------------------------------------

    def _batch(self, ranges: list[Range]) -> Batch:
        size = sum(stop - start for start, stop in ranges)
        dense = self._empty((size, INT_FEATURES), torch.float32)
        ids = self._empty((CAT_FEATURES, size), torch.int32)
        labels = self._empty((size,), torch.float32)
        dense_np, ids_np, labels_np = dense.numpy(), ids.numpy(), labels.numpy()
        at = 0
        for start, stop in ranges:
            for day, lo, hi in self._day_slices(start, stop):
                n = hi - lo
                dense_np[at : at + n] = day.dense[lo:hi]
                ids_np[:, at : at + n] = day.sparse[lo:hi].T  # KJT values are feature-major
                labels_np[at : at + n] = day.labels[lo:hi, 0]
                at += n
        return Batch(
            dense_features=dense,
            sparse_features=self._kjt_layout(size).kjt(self._values(ids)),
            labels=labels,
        )

    def _values(self, ids: torch.Tensor) -> torch.Tensor:
        """The KJT values of one-hot ``ids`` [features, batch]: multi-hot ones if configured."""
        if self._multi_hot is None:
            return ids.view(-1)
        values = self._empty((ids.shape[1] * sum(self._ids_per_feature),), torch.int32)
        expand(ids.numpy(), self._multi_hot, values.numpy())
        return values

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)

    def _kjt_layout(self, size: int) -> FixedLayout:
        """A fixed number of ids per feature per sample: the same lengths and offsets for every
        batch of a size, computed once (no KJT sync per batch)."""
        if size not in self._kjt_layouts:
            self._kjt_layouts[size] = FixedLayout(self.keys, self._ids_per_feature, size)
        return self._kjt_layouts[size]

    def _day_slices(self, start: int, stop: int) -> Iterator[tuple[DayArrays, int, int]]:
        """The pieces of rows [start, stop) in each day they span, as (day, lo, hi)."""
        d = int(np.searchsorted(self._day_starts, start, side="right")) - 1
        while start < stop:
            day_start = int(self._day_starts[d])
            hi = min(stop, int(self._day_starts[d + 1]))
            if hi > start:
                yield self.days[d], start - day_start, hi - day_start
            start = hi
            d += 1


class _EpochOrder:
    """The training rows of an epoch: blocks of consecutive rows, permuted per epoch."""

    def __init__(self, rows: int, block_rows: int, seed: int, shuffle: bool) -> None:
        self.rows = rows
        self.block_rows = block_rows
        self.seed = seed
        self.shuffle = shuffle
        self.blocks = math.ceil(rows / block_rows)
        self._epoch = -1

    def _load(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        order = np.arange(self.blocks)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.blocks)
        sizes = np.full(self.blocks, self.block_rows, dtype=np.int64)
        sizes[-1] = self.rows - self.block_rows * (self.blocks - 1)
        self._order = order
        self._ends = np.cumsum(sizes[order])  # position where each block of the order ends
        self._epoch = epoch

    def ranges(self, epoch: int, first: int, last: int) -> list[Range]:
        """The row ranges at positions [first, last) of the epoch's order."""
        self._load(epoch)
        k = int(np.searchsorted(self._ends, first, side="right"))
        ranges = []
        while first < last:
            block_start = int(self._ends[k - 1]) if k else 0
            n = min(last, int(self._ends[k])) - first
            row = int(self._order[k]) * self.block_rows + first - block_start
            ranges.append((row, row + n))
            first += n
            k += 1
        return ranges
