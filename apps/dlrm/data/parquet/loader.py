"""Click logs in Parquet files, local or in an object store, as TorchRec batches (``--data parquet``).

The files of ``--data_path`` (a folder, a glob or one file; a local path or an fsspec URL such as
``s3://bucket/clicks/``) are streamed where they are: each rank fetches only the row groups of its
own share, and only the columns training reads. Nothing is copied to the host first.

At start-up every rank reads the files' footers and refuses, before the first step, files and
columns that training could not use (:mod:`apps.dlrm.data.parquet.files`). The splits are those of
``--data criteo`` with the files as days: of the last ``--eval_days`` files' rows, the last
``--eval_fraction`` are held out, the first half validating, the rest testing.

Which rows a rank reads at each step (:mod:`apps.dlrm.data.parquet.order`) is a pure function of
(seed, step, rank, world size) computed from the footers' row counts: row groups permuted per
epoch and dealt to the ranks as equal runs of rows, then read in windows of
``--shuffle_buffer_rows`` rows shuffled in memory in blocks of ``--shuffle_block_rows``. Resuming at step ``s`` skips whole row groups
by their counts without reading them, and yields exactly the batches of an uninterrupted run.
Every rank steps ``steps_per_epoch`` times per epoch and gets as many evaluation batches as the
others, as the sharded model's collectives require.

A batch holds ``--batch_size`` rows: dense features (float32), labels (float32) and one
KeyedJaggedTensor of the sparse features, feature ``k`` keyed ``cat_k`` with its rows' ids (one
per row for an integer column, the list's for a list column; none for a null). Batches are
assembled with numpy gathers into tensors (pinned when training on a GPU) by a background thread a
few batches ahead (:mod:`apps.dlrm.data.prefetch`), while another reads the next window: fetching
and decoding row groups overlaps the batches of the window before.
"""

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.errors import ConfigError
from apps.core.common.splits import held_out_split
from apps.dlrm.config import TrainConfig
from apps.dlrm.data.parquet.files import CheckedFiles, null_report
from apps.dlrm.data.parquet.order import Pieces, TrainOrder, Window, eval_runs
from apps.dlrm.data.parquet.read import RowDecoder, RowGroupReader, Rows
from apps.dlrm.data.prefetch import prefetched
from apps.dlrm.model import feature_names

logger = logging.getLogger("apps.dlrm.data")

PREFETCH_THREAD = "parquet-prefetch"
READ_AHEAD_THREAD = "parquet-read-ahead"
Part = tuple[Rows, np.ndarray]  # some decoded rows, and which of them (in batch order) a batch takes

# Ids fit int32 (half the bytes to copy to the device) unless a table has more rows.
INT32_IDS = 2**31


class ParquetClickLogs:
    """Rank ``rank``'s batches of the Parquet files of ``cfg.data.data_path``."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, pin_memory: bool) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.pin_memory = pin_memory
        self.keys = feature_names(cfg.model.num_sparse_features)
        checked = CheckedFiles.open(cfg)
        fs, self.files, self.spec, self.null_counts = checked.fs, checked.files, checked.spec, checked.null_counts
        int32_ids = max(cfg.model.table_sizes) <= INT32_IDS
        id_dtype = np.dtype(np.int32 if int32_ids else np.int64)
        self._ids_dtype = torch.int32 if int32_ids else torch.int64
        decoder = RowDecoder(self.spec, cfg.model.table_sizes, cfg.data.categorical_ids, id_dtype)
        self._reader = RowGroupReader(fs, self.files, decoder)
        self.splits = held_out_split(
            [file.rows for file in self.files],
            cfg.data.eval_days,
            cfg.data.eval_fraction,
            cfg.data.data_path,
            files="files",
            more="add files",
        )
        self._groups = Pieces.of_groups([file.group_rows() for file in self.files])
        train_rows = self.splits["train"][1]
        self._order = TrainOrder(
            self._groups.between(0, train_rows),
            rank,
            world_size,
            cfg.training.batch_size,
            cfg.training.seed,
            cfg.data.shuffle,
            cfg.data.shuffle_buffer_rows,
            cfg.data.shuffle_block_rows,
        )
        self.steps_per_epoch = self._order.steps_per_epoch
        if not self.steps_per_epoch:
            raise ConfigError(
                f"{cfg.data.data_path} has {train_rows:,} training rows, fewer than one batch per rank "
                f"(--batch_size {cfg.training.batch_size} x {world_size} ranks): lower --batch_size"
            )
        logger.info(
            "parquet %s: %d files, %d row groups, %s rows: train %s (%d steps per epoch), validation %s, "
            "test %s; %d of %d sparse columns multi-hot; nulls (dense: 0, sparse: no id): %s",
            cfg.data.data_path,
            len(self.files),
            len(self._groups.hi),
            f"{self._groups.rows:,}",
            f"{train_rows:,}",
            self.steps_per_epoch,
            *(f"{stop - start:,}" for start, stop in (self.splits["val"], self.splits["test"])),
            sum(self.spec.multi_hot),
            len(self.spec.sparse),
            null_report(self.null_counts),
        )

    # --- iteration -----------------------------------------------------------------------------

    def teacher(self) -> None:
        """Real labels have no hidden teacher to compare with (no AUROC ceiling)."""
        return None

    def train_batches(self, start_step: int = 0) -> Generator[Batch, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        windows = _Windows(self._order, self._reader)
        batches = prefetched(
            lambda step: self._train_batch(windows, step), itertools.count(start_step), PREFETCH_THREAD
        )
        return _closing(batches, windows.close, self._log_nonfinite)

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """NaN or infinite dense values read so far (made 0), per column that had any."""
        return dict(self._reader.nonfinite)

    def _log_nonfinite(self) -> None:
        counts = self.nonfinite_counts
        if counts:
            logger.warning(
                "parquet: NaN or infinite dense values read (trained as 0, as nulls are): %s",
                ", ".join(f"{name} {n:,}" for name, n in counts.items()),
            )

    def eval_batches(self, split: str, num_batches: int) -> Generator[Batch, None, None]:
        """This rank's batches of ``split`` ("val" or "test"); ``num_batches`` 0: all of it."""
        start, stop = self.splits[split]
        runs = eval_runs(stop - start, start, self.rank, self.world_size, self.cfg.training.batch_size, num_batches)
        return prefetched(lambda i: self._batch(self._eval_parts(*runs[i])), range(len(runs)), PREFETCH_THREAD)

    def _eval_parts(self, first: int, last: int) -> list[Part]:
        return [
            (self._reader.group(f, g), np.arange(lo, hi))
            for f, g, lo, hi in self._groups.between(first, last).as_list()
        ]

    def _train_batch(self, windows: "_Windows", step: int) -> Batch:
        parts = []
        for epoch, w, first, last in self._order.step_rows(step):
            rows, order = windows.get(epoch, w)
            parts.append((rows, np.arange(first, last) if order is None else order[first:last]))
        return self._batch(parts)

    # --- batch assembly ------------------------------------------------------------------------

    def _batch(self, parts: list[Part]) -> Batch:
        return assemble_batch(parts, self.keys, len(self.spec.dense), self._ids_dtype, self.pin_memory)


def assemble_batch(
    parts: list[Part], keys: list[str], num_dense: int, ids_dtype: torch.dtype, pin_memory: bool = False
) -> Batch:
    """The batch of rows ``index`` of each part's rows, one gather per array into its tensor
    (feature after feature, and within one row after row: a KeyedJaggedTensor's order), its
    sparse features keyed ``keys``. Training, evaluation and scoring assemble batches alike."""

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    size = sum(len(index) for _, index in parts)
    dense = empty((size, num_dense), torch.float32)
    labels = empty((size,), torch.float32)
    lengths = empty((size * len(keys),), torch.int32)
    dense_np, labels_np, lengths_np = dense.numpy(), labels.numpy(), lengths.numpy()
    at = 0
    for rows, index in parts:
        # mode="clip": the indices are rows of the part by construction, and numpy's default
        # "raise" buffers the output to check them (1.6x the gather's time). The rows' dense
        # features are feature-major: gathered feature after feature, then transposed into the
        # batch's rows, a batch's worth in cache (a non-contiguous out= would copy it twice).
        dense_np[at : at + len(index)] = np.take(rows.dense, index, axis=1, mode="clip").T
        np.take(rows.labels, index, out=labels_np[at : at + len(index)], mode="clip")
        at += len(index)
    runs = [[rows.lengths(f, index) for rows, index in parts] for f in range(len(keys))]
    per_key = [
        sum(len(index) if n is None else int(n.sum()) for (_, index), n in zip(parts, feature)) for feature in runs
    ]
    values = empty((sum(per_key),), ids_dtype)
    values_np = values.numpy()
    at, row = 0, 0
    for f, feature in enumerate(runs):
        for (rows, index), n in zip(parts, feature):
            count = len(index) if n is None else int(n.sum())
            rows.take_ids(f, index, n, values_np[at : at + count])
            lengths_np[row : row + len(index)] = 1 if n is None else n
            at, row = at + count, row + len(index)
    return Batch(
        dense_features=dense,
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=values,
            lengths=lengths,
            stride=size,
            length_per_key=per_key,
            offset_per_key=[0, *itertools.accumulate(per_key)],
            index_per_key={key: f for f, key in enumerate(keys)},
        ),
        labels=labels,
    )


class _Windows:
    """The training windows of one iterator: the one batches are cut from, and the next, read by a
    thread of its own meanwhile, so that fetching and decoding it (from an object store, seconds)
    overlaps the batches of this one. Two windows are in memory at a time."""

    def __init__(self, order: TrainOrder, reader: RowGroupReader) -> None:
        self._order = order
        self._reader = reader
        self._read_ahead = ThreadPoolExecutor(1, thread_name_prefix=READ_AHEAD_THREAD)
        self._current: tuple[tuple[int, int], tuple[Rows, np.ndarray | None]] | None = None
        self._next: tuple[tuple[int, int], Future[tuple[Rows, np.ndarray | None]]] | None = None

    def get(self, epoch: int, index: int) -> tuple[Rows, np.ndarray | None]:
        """Window ``index`` of ``epoch``: its rows and their shuffled order (None: file order)."""
        key = (epoch, index)
        if self._current is None or self._current[0] != key:
            ahead = self._next[1] if self._next is not None and self._next[0] == key else None
            self._current = key, (ahead.result() if ahead is not None else self._read(*key))
            following = (epoch, index + 1) if index + 1 < len(self._order.windows(epoch)) else (epoch + 1, 0)
            # The window's pieces and order are found here: the order's per-epoch state is this thread's.
            self._next = following, self._read_ahead.submit(self._read_window, self._order.window(*following))
        return self._current[1]

    def _read(self, epoch: int, index: int) -> tuple[Rows, np.ndarray | None]:
        return self._read_window(self._order.window(epoch, index))

    def _read_window(self, window: Window) -> tuple[Rows, np.ndarray | None]:
        return self._reader.read(window.pieces), window.order

    def close(self) -> None:
        self._read_ahead.shutdown(wait=True, cancel_futures=True)


def _closing(batches: Generator[Batch, None, None], *closers: Callable[[], None]) -> Generator[Batch, None, None]:
    """``batches``, then each of ``closers`` called once they are closed (or exhausted)."""
    try:
        yield from batches
    finally:
        batches.close()
        for close in closers:
            close()
