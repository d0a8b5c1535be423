"""Synthetic click logs that a DLRM can learn, generated on the fly on the training device.

Every sample has dense features ~ N(0, 1) and ``m_t`` ids for each sparse feature ``t``
(``--multi_hot_sizes``; one by default), each drawn from a power law (a few ids are hot, most are
rare, as in real click logs) and scattered over the table by a per-table permutation. Its label
is drawn from a hidden logistic *teacher*:

    logit = bias + sum_t pool_t(w_t(id) for its ids) + v . dense,   label ~ Bernoulli(sigmoid(logit))

where ``w_t(id)`` is a pseudo-random normal weight derived from a hash of (seed, table, id), so
the teacher needs no memory however large the tables are, and ``pool_t`` sums or averages a
feature's ids as the model's embedding bags do (``--pooling``), so the model can represent it.
The teacher's own AUROC is the best any model can reach on this data: the app reports it as
``auroc_ceiling``. With one id per feature, sum and mean are the same and the batches are those
this module made before multi-hot features existed.

Samples come in blocks of ``batch_size``; block ``k`` of a split is a pure function of
(seed, split, k). Training step ``s`` on rank ``r`` of ``W`` reads block ``s * W + r``, so ranks
never overlap, and a single process reading blocks ``s * W ... s * W + W - 1`` sees exactly the
global batch of step ``s``.

Why on the device, with a counter-based hash instead of a random generator: a GPU trains a
16384-sample batch in a few milliseconds, while building it with NumPy on one CPU core took
~44 ms. Here a batch is a few dozen tensor operations on the rank's own device, with no copy
and no per-sample Python. Every random number is SplitMix64 of a counter, pure 64-bit integer
arithmetic, so a block has the same ids and dense values on a CPU and on a GPU (labels and the
teacher's logits, which go through float64 ``log``/``exp``, up to rounding).
"""

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch
from torchrec.datasets.utils import Batch

from apps.core.common.hashing import GOLDEN_GAMMA, MASK64, mix64, mix64_int, shift_right, signed
from apps.core.data import RankShare
from apps.dlrm.config import DataConfig, ModelConfig
from apps.dlrm.data.criteo.tables import feature_names
from apps.dlrm.data.kjt_layout import FixedLayout

SPLITS = {"train": 0, "val": 1, "test": 2}

# Teacher scales: the sparse part and the dense part each contribute a logit of std ~1,
# which puts the teacher's AUROC (the ceiling) near 0.8, like a good CTR model on real logs.
_SPARSE_LOGIT_STD = 1.0
_DENSE_LOGIT_STD = 1.0
_BIAS = -1.0

# Independent random streams of one block: a counter's high bits say which stream it is in.
_IDS, _DENSE, _LABELS, _DENSE_WEIGHTS = range(4)
_STREAM_SHIFT = 40  # a block may hold up to 2**40 numbers per stream


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """Floats in (0, 1) from the top 53 bits of each value."""
    return (shift_right(bits, 11).double() + 0.5) / float(1 << 53)


def normal(bits: torch.Tensor) -> torch.Tensor:
    """A standard normal float64 per value, by Box-Muller from its two 24-bit halves."""
    u1 = (shift_right(bits, 40).double() + 0.5) / float(1 << 24)
    u2 = ((bits & ((1 << 24) - 1)).double() + 0.5) / float(1 << 24)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


CPU = torch.device("cpu")


@dataclass
class GpuMadeBatch(Batch):
    """A batch whose tensors GPU kernels are still writing, on the stream that launched them.

    TorchRec's pipelines take every batch "to the device" on a copy stream of their own, which
    does not wait for the default stream: for this batch, already there, that step makes the
    taking stream wait for ``ready`` (an event recorded after the kernels) instead of copying.
    The pipelines then ``record_stream`` it for every stream that uses it, as for any batch.
    """

    ready: Any = None  # torch.cuda.Event

    def to(self, device: torch.device, non_blocking: bool = False, **kwargs: Any) -> Batch:
        if torch.device(device) != self.labels.device:
            return super().to(device, non_blocking=non_blocking)
        torch.cuda.current_stream(self.labels.device).wait_event(self.ready)
        return self


class SyntheticClickLogs:
    """Deterministic, rank-partitioned synthetic batches and their teacher logits, made on ``device``."""

    #: Synthetic data never repeats: it has no epochs.
    steps_per_epoch = None
    #: Its features are the options' (see :class:`~apps.dlrm.data.ClickLogs`).
    columns: dict[str, Any] | None = None

    def __init__(self, model: ModelConfig, data: DataConfig, share: RankShare, device: torch.device = CPU) -> None:
        self.model, self.data, self.share = model, data, share
        self.device = device
        self.keys = feature_names(model.num_sparse_features)
        seed, rows, sizes = share.seed, model.table_sizes, model.ids_per_feature
        # A sample's ids are a row of [batch, sum(sizes)] columns, feature t's in m_t of them.
        feature = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
        self._rows = torch.tensor(rows, dtype=torch.int64, device=device)[feature]
        self._multipliers = torch.tensor(
            [_coprime_multiplier(n, seed * 7919 + t) for t, n in enumerate(rows)], device=device
        )[feature]
        self._offsets = torch.tensor(
            [(mix64_int(seed + 31 * t) & MASK64) % n for t, n in enumerate(rows)], device=device
        )[feature]
        self._table_keys = torch.tensor(
            [mix64_int(seed * 1_000_003 + t) for t in range(model.num_sparse_features)], device=device
        )[feature]
        weights = normal(self._stream(mix64_int(seed * 104_729 + 99), _DENSE_WEIGHTS, model.num_dense_features))
        self._dense_weights = weights * (_DENSE_LOGIT_STD / math.sqrt(model.num_dense_features))
        self._mean = model.pooling == "mean"
        # 1/m_t per column: mean pooling; the variance of a pooled term is m_t (sum) or 1/m_t (mean)
        self._pool_weights = 1.0 / torch.tensor(sizes, dtype=torch.float64, device=device)[feature]
        variance = sum(1.0 / m if self._mean else m for m in sizes)
        self._sparse_scale = _SPARSE_LOGIT_STD / math.sqrt(variance)
        self._layout = FixedLayout(self.keys, sizes, share.batch_size, device)
        self._to_kjt, self._from_kjt = _kjt_order(share.batch_size, sizes, device)

    # --- sampling ------------------------------------------------------------------------------

    def _stream(self, key: int, stream: int, count: int) -> torch.Tensor:
        """``count`` random 64-bit values of one stream of the block with ``key``."""
        counters = torch.arange(count, dtype=torch.int64, device=self.device) + (stream << _STREAM_SHIFT)
        return mix64(counters * signed(GOLDEN_GAMMA) + key)

    def _power_law_ids(self, u: torch.Tensor) -> torch.Tensor:
        """Inverse CDF of a power law with exponent s over [1, rows], scattered over each table.

        ``u`` is [batch, columns]: column ``c`` holds ids of the feature that ``self._rows[c]``
        and the other per-column tensors describe.
        """
        s = self.data.zipf_exponent
        n = self._rows.double()[None, :]
        if abs(s - 1.0) < 1e-9:
            x = torch.exp(u * torch.log(n + 1.0))
        else:
            x = (1.0 + u * ((n + 1.0) ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
        ranks = torch.minimum(x.long() - 1, self._rows[None, :] - 1).clamp_(min=0)
        return (ranks * self._multipliers[None, :] + self._offsets[None, :]) % self._rows[None, :]

    def block(self, split: str, index: int) -> Batch:
        """Block ``index`` of ``split``: ``batch_size`` samples on this object's device."""
        b, columns = self.share.batch_size, self._rows.numel()
        key = mix64_int(mix64_int(mix64_int(self.share.seed) + SPLITS[split]) + index)
        ids = self._power_law_ids(uniform(self._stream(key, _IDS, b * columns)).view(b, columns))
        dense = normal(self._stream(key, _DENSE, b * self.model.num_dense_features)).view(b, -1).float()
        logits = self._teacher(ids, dense)
        labels = (uniform(self._stream(key, _LABELS, b)) < torch.sigmoid(logits)).float()
        sparse = self._layout.kjt(ids.view(-1)[self._to_kjt])
        if self.device.type != "cuda":
            return Batch(dense_features=dense, sparse_features=sparse, labels=labels)
        ready = torch.cuda.Event()
        ready.record()
        return GpuMadeBatch(dense_features=dense, sparse_features=sparse, labels=labels, ready=ready)

    def _teacher(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The teacher's float64 logits of samples with ``ids`` [batch, columns] and ``dense``."""
        weights = normal(mix64(ids ^ self._table_keys[None, :]))
        if self._mean:
            weights = weights * self._pool_weights[None, :]
        return _BIAS + self._sparse_scale * weights.sum(dim=1) + dense.double() @ self._dense_weights

    def teacher(self) -> Callable[[Batch], torch.Tensor]:
        """The hidden teacher the labels are drawn from: :meth:`teacher_logits`."""
        return self.teacher_logits

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """The hidden teacher's logits for a batch this class generated, on the batch's device."""
        b = batch.labels.shape[0]
        ids = batch.sparse_features.values().to(self.device)[self._from_kjt].view(b, -1)
        return self._teacher(ids, batch.dense_features.to(self.device)).float()

    # --- iteration -----------------------------------------------------------------------------

    def train_batches(self, start_step: int = 0) -> Generator[Batch, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        step = start_step
        while True:
            yield self.block("train", self.share.block(step))
            step += 1

    def eval_batches(self, split: str, num_batches: int) -> Generator[Batch, None, None]:
        """This rank's ``num_batches`` batches of the ``val`` or ``test`` split."""
        for i in range(num_batches):
            yield self.block(split, self.share.block(i))


def _kjt_order(batch: int, sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers between ids [batch, sum(sizes)] and KJT values, and back.

    A KeyedJaggedTensor holds its values feature after feature and, within a feature, sample
    after sample; ``ids.view(-1)[to_kjt]`` is that order, ``values[from_kjt]`` the ids again.
    """
    starts = [0, *itertools.accumulate(sizes)]
    grid = torch.arange(batch * starts[-1], device=device).view(batch, -1)
    to_kjt = torch.cat([grid[:, lo:hi].reshape(-1) for lo, hi in zip(starts, starts[1:])])
    return to_kjt, torch.argsort(to_kjt)


def _coprime_multiplier(rows: int, salt: int) -> int:
    """A multiplier coprime with ``rows``: ``id * a + c mod rows`` permutes the table."""
    a = ((mix64_int(salt) & MASK64) % max(rows, 1)) | 1
    while math.gcd(a, rows) != 1:
        a += 2
    return a % rows if rows > 1 else 0
