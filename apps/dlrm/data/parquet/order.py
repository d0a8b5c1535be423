"""Which rows of which row groups each rank reads, in which order: arithmetic on row counts only.

The rows of all files, in file order, are cut into *pieces*: a piece is rows ``[lo, hi)`` of one
row group of one file (a whole row group, except where a split boundary cuts one). Training reads
the pieces of the training rows; evaluation the pieces of its split.

Training. Epoch ``e`` permutes the training pieces with a generator seeded by ``(seed, e)`` (file
order without --shuffle). Of the ``T`` rows of that order, rank ``r`` of ``W`` takes the run
starting at position ``r * T // W``: the shares are disjoint and all ranks step alike, an epoch
being ``(T // W) // B`` steps of ``B`` (--batch_size) rows, so only ``steps * B`` rows of each
share are read (the others are left out this epoch and come back shuffled in the next). A share
is read in *windows*: runs of consecutive pieces of at least --shuffle_buffer_rows rows, cut
into blocks of --shuffle_block_rows consecutive rows that are permuted by a generator seeded by
``(seed, e, r, window)`` (:func:`block_permutation`; blocks of 1 row permute the rows). Blocks
because a batch is then gathered from a few runs of consecutive rows, which the CPU's caches
serve, rather than from rows scattered over the whole window (5x the gathering's CPU time);
a batch still mixes ``B / block`` places of several row groups, as the Criteo loader's do. Step ``s`` is then rows
``[i * B, (i + 1) * B)`` of the rank's windows one after another, with ``e, i = divmod(s, steps)``:
a pure function of (seed, step, rank, world size), found from row counts without reading a byte,
so a resumed run reads exactly the batches of an uninterrupted one.

Evaluation. Rank ``r`` takes the ``r``-th of ``W`` equal runs of ``N // W`` rows of the split's
``N`` (at most ``W - 1`` rows left out), in file order, in batches of ``B`` rows, the last one
smaller: every rank has the same number of batches, as the sharded model's collectives need,
and reads only its run's row groups.
"""

import math
from dataclasses import dataclass

import numpy as np

from apps.core.data import RankShare

Piece = tuple[int, int, int, int]  # (file, row group, lo, hi): rows [lo, hi) of that row group


@dataclass(frozen=True)
class Pieces:
    """Pieces in some order, as columns, with where each ends in that order's row positions."""

    file: np.ndarray
    group: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def of_groups(cls, group_rows: list[list[int]]) -> "Pieces":
        """Every row group of every file, whole, in file order."""
        file = np.repeat(np.arange(len(group_rows)), [len(rows) for rows in group_rows])
        group = np.concatenate([np.arange(len(rows)) for rows in group_rows]).astype(np.int64)
        hi = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in group_rows])
        return cls(file, group, np.zeros_like(hi), hi)

    @property
    def rows(self) -> int:
        return int(self.ends[-1]) if len(self.hi) else 0

    @property
    def ends(self) -> np.ndarray:
        return np.cumsum(self.hi - self.lo)

    def take(self, order: np.ndarray) -> "Pieces":
        return Pieces(self.file[order], self.group[order], self.lo[order], self.hi[order])

    def between(self, first: int, last: int) -> "Pieces":
        """The pieces of positions [first, last), cut where they begin or end inside one."""
        ends = self.ends
        k = int(np.searchsorted(ends, first, side="right"))
        stop = int(np.searchsorted(ends, last, side="left")) + 1
        cut = self.take(np.arange(k, min(stop, len(ends))))
        starts = ends[k:stop] - (self.hi[k:stop] - self.lo[k:stop])  # positions where each begins
        lo = cut.lo + np.maximum(first - starts, 0)
        hi = cut.hi - np.maximum(ends[k:stop] - last, 0)
        return Pieces(cut.file, cut.group, lo, hi)

    def as_list(self) -> list[Piece]:
        return list(zip(self.file.tolist(), self.group.tolist(), self.lo.tolist(), self.hi.tolist()))


@dataclass(frozen=True)
class Window:
    """Rows of consecutive pieces read and shuffled together, taken in the order of ``runs``."""

    pieces: list[Piece]
    # int64 [m, 2]: (start, stop) of runs of consecutive rows of the window, one run after
    # another (one run of every row: not shuffled). Runs, not a row index: a batch copies its
    # rows run by run, a block of 1024 rows at a time, instead of gathering them row by row.
    runs: np.ndarray
    ends: np.ndarray  # int64 [m]: where each run ends in the window's order

    @classmethod
    def of(cls, pieces: list[Piece], runs: np.ndarray) -> "Window":
        return cls(pieces, runs, np.cumsum(runs[:, 1] - runs[:, 0]))

    def runs_between(self, first: int, last: int) -> np.ndarray:
        """The runs of positions [first, last) of the window's order, cut where they begin or end
        inside one."""
        k = int(np.searchsorted(self.ends, first, side="right"))
        stop = int(np.searchsorted(self.ends, last, side="left")) + 1
        cut = self.runs[k:stop].copy()
        starts = self.ends[k:stop] - (cut[:, 1] - cut[:, 0])  # positions where each begins
        cut[:, 0] += np.maximum(first - starts, 0)
        cut[:, 1] -= np.maximum(self.ends[k:stop] - last, 0)
        return cut


class TrainOrder:
    """One rank's training rows of every epoch, in windows (see the module docstring)."""

    def __init__(self, pieces: Pieces, share: RankShare, shuffle: bool, window_rows: int, block_rows: int) -> None:
        self.pieces = pieces
        self.share = share
        self.shuffle = shuffle
        self.window_rows = window_rows
        self.block_rows = block_rows
        self.steps_per_epoch = (pieces.rows // share.world_size) // share.batch_size
        self._epoch = -1

    def windows(self, epoch: int) -> list[list[Piece]]:
        """The pieces of each of this rank's windows in ``epoch`` (the last epoch's are kept)."""
        if epoch != self._epoch:
            order = np.arange(len(self.pieces.hi))
            if self.shuffle:
                order = np.random.default_rng([self.share.seed, epoch]).permutation(len(order))
            first = self.share.rank * self.pieces.rows // self.share.world_size
            own = self.pieces.take(order).between(first, first + self.steps_per_epoch * self.share.batch_size)
            self._windows = _group(own.as_list(), self.window_rows)
            self._window_ends = np.cumsum([sum(hi - lo for _, _, lo, hi in w) for w in self._windows])
            self._epoch = epoch
        return self._windows

    def window(self, epoch: int, index: int) -> Window:
        pieces = self.windows(epoch)[index]
        rows = sum(hi - lo for _, _, lo, hi in pieces)
        runs = np.array([[0, rows]], dtype=np.int64)
        if self.shuffle:
            runs = block_runs(
                np.random.default_rng([self.share.seed, epoch, self.share.rank, index]), rows, self.block_rows
            )
        return Window.of(pieces, runs)

    def step_rows(self, step: int) -> list[tuple[int, int, int, int]]:
        """Where step ``step``'s rows are: (epoch, window, first, last) rows of those windows."""
        epoch, index = divmod(step, self.steps_per_epoch)
        self.windows(epoch)
        first, last = index * self.share.batch_size, (index + 1) * self.share.batch_size
        w = int(np.searchsorted(self._window_ends, first, side="right"))
        parts = []
        while first < last:
            start = int(self._window_ends[w - 1]) if w else 0
            stop = min(last, int(self._window_ends[w]))
            parts.append((epoch, w, first - start, stop - start))
            first = stop
            w += 1
        return parts


def block_runs(rng: np.random.Generator, rows: int, block_rows: int) -> np.ndarray:
    """Positions ``0 .. rows - 1`` cut into blocks of ``block_rows`` (the last may be shorter),
    the blocks in the order of ``rng.permutation``: int64 [blocks, 2], each block's (start, stop)."""
    starts = rng.permutation(-(-rows // block_rows)).astype(np.int64) * block_rows
    return np.stack([starts, np.minimum(starts + block_rows, rows)], axis=1)


def block_permutation(rng: np.random.Generator, rows: int, block_rows: int) -> np.ndarray:
    """The positions of :func:`block_runs`, one after another, each block's rows in order: the
    order a shuffled window's rows are read in. Blocks of 1 row: ``rng.permutation(rows)`` itself."""
    return run_rows(block_runs(rng, rows, block_rows))


def run_rows(runs: np.ndarray) -> np.ndarray:
    """The positions of ``runs`` (int64 [m, 2] of (start, stop)), one run after another."""
    lengths = runs[:, 1] - runs[:, 0]
    return np.repeat(runs[:, 0] - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))


def _group(pieces: list[Piece], window_rows: int) -> list[list[Piece]]:
    """Consecutive pieces in runs of at least ``window_rows`` rows (the last run may be shorter)."""
    windows: list[list[Piece]] = [[]]
    rows = 0
    for piece in pieces:
        if rows >= window_rows:
            windows.append([])
            rows = 0
        windows[-1].append(piece)
        rows += piece[3] - piece[2]
    return windows if windows[0] else []


def eval_runs(rows: int, start: int, share: RankShare, num_batches: int) -> list[tuple[int, int]]:
    """The evaluation batches ``share`` reads of a split of ``rows`` rows from position ``start``,
    as [first, last) positions; ``num_batches`` 0: all of them, else at most that many."""
    per_rank = rows // share.world_size
    first = start + share.rank * per_rank
    batch_size = share.batch_size
    count = math.ceil(per_rank / batch_size)
    if num_batches:
        count = min(count, num_batches)
    return [(first + i * batch_size, first + min((i + 1) * batch_size, per_rank)) for i in range(count)]
