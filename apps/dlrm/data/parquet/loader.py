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
copied into tensors (pinned when training on a GPU) run of rows by run of rows, a shuffle block
at a time (:class:`_Take`), by a background thread a few batches ahead
(:mod:`apps.dlrm.data.prefetch`), while another reads the next window: fetching and decoding row
groups overlaps the batches of the window before. Windows are decoded into memory reused from
window to window (:mod:`apps.dlrm.data.parquet.pool`).
"""

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.errors import ConfigError
from apps.core.common.kjt import sized_kjt
from apps.core.data import RankShare
from apps.dlrm.config import DataConfig, ModelConfig, zch_features
from apps.dlrm.data.criteo.tables import feature_names
from apps.dlrm.data.parquet.files import UNSCALED_DENSE, CheckedFiles, dense_ranges, null_report, unscaled_dense
from apps.dlrm.data.parquet.order import Pieces, TrainOrder, Window, eval_runs, run_rows
from apps.dlrm.data.parquet.read import RowDecoder, RowGroupReader, Rows, id_ranges
from apps.dlrm.data.prefetch import prefetched
from apps.dlrm.data.trained import TrainedColumns

logger = logging.getLogger("apps.dlrm.data")

PREFETCH_THREAD = "parquet-prefetch"
READ_AHEAD_THREAD = "parquet-read-ahead"
# Some decoded rows, and which of them a batch takes: int64 [m, 2], (start, stop) of runs of
# consecutive rows, one run after another in the batch's order.
Part = tuple[Rows, np.ndarray]

# Runs at least this long on average are copied run by run, shorter ones gathered (see _Take):
# a batch of 32-row runs gathers in 70 ns a row and copies in 86, of 64-row runs 88 and 58.
COPIED_RUN_ROWS = 64

# Ids fit int32 (half the bytes to copy to the device) unless a table has more rows.
INT32_IDS = 2**31


class ParquetClickLogs:
    """The batches of the Parquet files of ``data.data_path`` that ``share`` says this rank reads;
    with ``trained``, the columns the options match fed in the order a checkpoint's model read them."""

    def __init__(
        self,
        model: ModelConfig,
        data: DataConfig,
        share: RankShare,
        pin_memory: bool,
        trained: TrainedColumns | None = None,
    ) -> None:
        self.data, self.share = data, share
        self.pin_memory = pin_memory
        self.keys = feature_names(model.num_sparse_features)
        checked = CheckedFiles.open(model, data, trained=trained)
        fs, self.files, self.spec, self.null_counts = checked.fs, checked.files, checked.spec, checked.null_counts
        self.columns: dict[str, Any] | None = self.spec.record()
        managed = zch_features(model, data)
        int32_ids = max(id_ranges(data.categorical_ids, model.table_sizes, managed)) <= INT32_IDS
        id_dtype = np.dtype(np.int32 if int32_ids else np.int64)
        self._ids_dtype = torch.int32 if int32_ids else torch.int64
        log1p = data.dense_transform == "log1p"
        decoder = RowDecoder(self.spec, model.table_sizes, data.categorical_ids, id_dtype, log1p, managed)
        if share.rank == 0:
            self._warn_of_dense_scale(log1p)
            self._warn_of_empty_columns()
        self._reader = RowGroupReader(fs, self.files, decoder)
        self.splits = checked.splits(data)
        self._groups = Pieces.of_groups([file.group_rows() for file in self.files])
        train_rows = self.splits["train"][1]
        self._order = TrainOrder(
            self._groups.between(0, train_rows),
            share,
            data.shuffle,
            data.shuffle_buffer_rows,
            data.shuffle_block_rows,
        )
        self.steps_per_epoch = self._order.steps_per_epoch
        if not self.steps_per_epoch:
            raise ConfigError(
                f"{data.data_path} has {train_rows:,} training rows, fewer than one batch per rank "
                f"(--batch_size {share.batch_size} x {share.world_size} ranks): lower --batch_size"
            )
        logger.info(
            "parquet %s: %d files, %d row groups, %s rows: train %s (%d steps per epoch), validation %s, "
            "test %s; %d of %d sparse columns multi-hot; nulls (dense: 0, sparse: no id): %s",
            data.data_path,
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

    def _warn_of_dense_scale(self, log1p: bool) -> None:
        """Names the dense columns whose values (as the footers' statistics record them) the model
        would take badly: far from 0 as they are, or negative where log1p's clip makes them 0."""
        ranges = dense_ranges(self.files, self.spec)
        unscaled = unscaled_dense(ranges)
        if unscaled and not log1p:
            logger.warning(
                "parquet %s: dense columns with values beyond +-%g, which an MLP trains poorly on: %s; give "
                "--dense_transform log1p (log(1 + max(x, 0)), for counts, prices, durations) or scale them where "
                "the files are written",
                self.data.data_path,
                UNSCALED_DENSE,
                ", ".join(f"{name} (up to {value:.3g})" for name, value in unscaled.items()),
            )
        negative = {name: low for name, (low, _) in ranges.items() if low < 0}
        if negative and log1p:
            logger.warning(
                "parquet %s: --dense_transform log1p makes negative values 0 (log(1 + max(x, 0))), and dense "
                "columns hold some: %s; if they are already scaled, scale every column where the files are "
                "written and train with --dense_transform none",
                self.data.data_path,
                ", ".join(f"{name} (down to {value:.3g})" for name, value in negative.items()),
            )

    def _warn_of_empty_columns(self) -> None:
        """Names the feature columns that hold no value at all (every row null, as the statistics
        count): they train as constants, most often a column name or a writer gone wrong."""
        rows = sum(file.rows for file in self.files)
        empty = [name for name, count in self.null_counts.items() if name != self.spec.label and count == rows]
        if empty and rows:
            logger.warning(
                "parquet %s: columns null in all %s rows, which train as constants (dense 0, sparse no id): %s; "
                "check the columns' names, or where the files are written",
                self.data.data_path,
                f"{rows:,}",
                ", ".join(empty),
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
        runs = eval_runs(stop - start, start, self.share, num_batches)
        return prefetched(lambda i: self._batch(self._eval_parts(*runs[i])), range(len(runs)), PREFETCH_THREAD)

    def _eval_parts(self, first: int, last: int) -> list[Part]:
        return [
            (self._reader.group(f, g), np.array([[lo, hi]], dtype=np.int64))
            for f, g, lo, hi in self._groups.between(first, last).as_list()
        ]

    def _train_batch(self, windows: "_Windows", step: int) -> Batch:
        parts = []
        for epoch, w, first, last in self._order.step_rows(step):
            rows, window = windows.get(epoch, w)
            parts.append((rows, window.runs_between(first, last)))
        return self._batch(parts)

    # --- batch assembly ------------------------------------------------------------------------

    def _batch(self, parts: list[Part]) -> Batch:
        return assemble_batch(parts, self.keys, len(self.spec.dense), self._ids_dtype, self.pin_memory)


def assemble_batch(
    parts: list[Part], keys: list[str], num_dense: int, ids_dtype: torch.dtype, pin_memory: bool = False
) -> Batch:
    """The batch of the runs of rows of each part, one after another, its arrays copied into
    tensors run by run (feature after feature, and within one row after row: a
    KeyedJaggedTensor's order), its sparse features keyed ``keys``. Training, evaluation and
    scoring assemble batches alike."""

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    takes = [(rows, _Take(runs)) for rows, runs in parts]
    size = sum(take.size for _, take in takes)
    dense = empty((size, num_dense), torch.float32)
    labels = empty((size,), torch.float32)
    # The rows' dense features are feature-major: copied so, then transposed into the batch's
    # rows, a batch's worth in cache (a transposing copy out of the rows reads 13 places a window
    # apart at once, which share cache sets: twice the time).
    dense_by_feature = np.empty((num_dense, size), dtype=np.float32)
    at = 0
    for rows, take in takes:
        take.into(rows.dense, dense_by_feature[:, at : at + take.size])
        take.into(rows.labels, labels.numpy()[at : at + take.size])
        at += take.size
    dense.numpy()[:] = dense_by_feature.T
    return Batch(dense_features=dense, sparse_features=_sparse_features(takes, keys, ids_dtype, empty), labels=labels)


def _sparse_features(
    takes: list[tuple[Rows, "_Take"]],
    keys: list[str],
    ids_dtype: torch.dtype,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
) -> KeyedJaggedTensor:
    """The KeyedJaggedTensor of the rows ``takes`` take, feature after feature."""
    size = sum(take.size for _, take in takes)
    # A ragged feature's ids of a run of rows are one run of its ids, from offset to offset.
    id_takes = {
        (f, p): _Take(ragged.offsets[take.runs])
        for p, (rows, take) in enumerate(takes)
        for f, ragged in enumerate(rows.ragged)
        if ragged is not None
    }
    ragged_features = {f for f, _ in id_takes}  # none or several ids in a row of some part
    per_key = [
        sum(id_takes.get((f, p), take).size for p, (_, take) in enumerate(takes)) if f in ragged_features else size
        for f in range(len(keys))
    ]
    values = empty((sum(per_key),), ids_dtype)
    lengths = empty((len(keys) * size,), torch.int32)
    values_np, lengths_np = values.numpy(), lengths.numpy().reshape(len(keys), size)
    at = 0
    for several, group in itertools.groupby(range(len(keys)), ragged_features.__contains__):
        features = list(group)
        if not several:  # consecutive features with one id per row in every part: their ids at once
            first, stop = features[0], features[-1] + 1
            span = values_np[at : at + len(features) * size].reshape(len(features), size)
            row = 0
            for rows, take in takes:
                take.into(rows.ids[first:stop], span[:, row : row + take.size])
                row += take.size
            lengths_np[first:stop] = 1
            at += len(features) * size
            continue
        for f in features:
            row = 0
            for p, (rows, take) in enumerate(takes):
                ragged = rows.ragged[f]
                if ragged is None:
                    take.into(rows.ids[f], values_np[at : at + take.size])
                    lengths_np[f, row : row + take.size] = 1
                    at += take.size
                else:
                    id_take = id_takes[f, p]
                    id_take.into(ragged.ids, values_np[at : at + id_take.size])
                    take.into(ragged.lengths, lengths_np[f, row : row + take.size])
                    at += id_take.size
                row += take.size
    return sized_kjt(keys, values, lengths, per_key, stride=size)


class _Take:
    """Which rows of a part's arrays a batch takes: ``runs`` (int64 [m, 2] of (start, stop)),
    one run after another, and how it copies them. Runs of ``COPIED_RUN_ROWS`` rows or more
    (shuffle blocks; evaluation and scoring take one run) are copied run by run, a few numpy
    calls each; shorter ones (a small --shuffle_block_rows) are gathered through an index of
    every row, as a call per run would cost more than the gather."""

    def __init__(self, runs: np.ndarray) -> None:
        self.runs = runs
        self.size = int((runs[:, 1] - runs[:, 0]).sum())
        self._index = run_rows(runs) if len(runs) * COPIED_RUN_ROWS > self.size else None

    def into(self, source: np.ndarray, out: np.ndarray) -> None:
        """Writes the rows of ``source`` (rows on its last axis) into ``out`` (``size`` long)."""
        if self._index is not None:
            # mode="clip": the indices are rows of the part by construction, and numpy's default
            # "raise" buffers the output to check them (1.6x the gather's time).
            np.take(source, self._index, axis=-1, out=out, mode="clip")
            return
        at = 0
        for lo, hi in self.runs.tolist():
            out[..., at : at + hi - lo] = source[..., lo:hi]
            at += hi - lo


class _Windows:
    """The training windows of one iterator: the one batches are cut from, and the next, read by a
    thread of its own meanwhile, so that fetching and decoding it (from an object store, seconds)
    overlaps the batches of this one. Two windows are in memory at a time."""

    def __init__(self, order: TrainOrder, reader: RowGroupReader) -> None:
        self._order = order
        self._reader = reader
        self._read_ahead = ThreadPoolExecutor(1, thread_name_prefix=READ_AHEAD_THREAD)
        self._current: tuple[tuple[int, int], tuple[Rows, Window]] | None = None
        self._next: tuple[tuple[int, int], Future[tuple[Rows, Window]]] | None = None

    def get(self, epoch: int, index: int) -> tuple[Rows, Window]:
        """Window ``index`` of ``epoch``: its rows, and the window (which says their order)."""
        key = (epoch, index)
        if self._current is None or self._current[0] != key:
            ahead = self._next[1] if self._next is not None and self._next[0] == key else None
            self._current = key, (ahead.result() if ahead is not None else self._read(*key))
            following = (epoch, index + 1) if index + 1 < len(self._order.windows(epoch)) else (epoch + 1, 0)
            # The window's pieces and order are found here: the order's per-epoch state is this thread's.
            self._next = following, self._read_ahead.submit(self._read_window, self._order.window(*following))
        return self._current[1]

    def _read(self, epoch: int, index: int) -> tuple[Rows, Window]:
        return self._read_window(self._order.window(epoch, index))

    def _read_window(self, window: Window) -> tuple[Rows, Window]:
        return self._reader.read(window.pieces), window

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
