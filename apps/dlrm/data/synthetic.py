"""Synthetic click logs that a DLRM can learn, generated on the fly.

Every sample has dense features ~ N(0, 1) and one id per sparse feature, drawn from a power law
(a few ids are hot, most are rare, as in real click logs) and scattered over the table by a
per-table permutation. Its label is drawn from a hidden logistic *teacher*:

    logit = bias + sum_t w_t(id_t) + v . dense,     label ~ Bernoulli(sigmoid(logit))

where ``w_t(id)`` is a pseudo-random normal weight derived from a hash of (seed, table, id), so
the teacher needs no memory however large the tables are. The teacher's own AUROC is the best
any model can reach on this data: the app reports it as ``auroc_ceiling``.

Samples come in blocks of ``batch_size``; block ``k`` of a split is a pure function of
(seed, split, k). Training step ``s`` on rank ``r`` of ``W`` reads block ``s * W + r``, so ranks
never overlap, and a single process reading blocks ``s * W ... s * W + W - 1`` sees exactly the
global batch of step ``s``.
"""

import math
from typing import Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.config import TrainConfig
from apps.dlrm.model import feature_names

SPLITS = {"train": 0, "val": 1, "test": 2}

# Teacher scales: the sparse part and the dense part each contribute a logit of std ~1,
# which puts the teacher's AUROC (the ceiling) near 0.8, like a good CTR model on real logs.
_SPARSE_LOGIT_STD = 1.0
_DENSE_LOGIT_STD = 1.0
_BIAS = -1.0

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a fast bijective hash of uint64 values."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _hash_normal(seed: int, table: int, ids: np.ndarray) -> np.ndarray:
    """A standard normal value per id, a pure function of (seed, table, id)."""
    key = _mix64(np.array([seed * 1_000_003 + table], dtype=_U64))[0]
    bits = _mix64(ids.astype(_U64) ^ key)
    u1 = ((bits >> _U64(40)).astype(np.float64) + 0.5) / float(1 << 24)
    u2 = ((bits & _U64((1 << 24) - 1)).astype(np.float64) + 0.5) / float(1 << 24)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def _coprime_multiplier(rows: int, salt: int) -> int:
    """A multiplier coprime with ``rows``: ``id * a + c mod rows`` permutes the table."""
    a = int(_mix64(np.array([salt], dtype=_U64))[0] % _U64(max(rows, 1))) | 1
    while math.gcd(a, rows) != 1:
        a += 2
    return a % rows if rows > 1 else 0


class SyntheticClickLogs:
    """Deterministic, rank-partitioned synthetic batches and their teacher logits."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.keys = feature_names(cfg.num_sparse_features)
        self.rows = np.array(cfg.table_sizes, dtype=np.int64)
        self._multipliers = np.array(
            [_coprime_multiplier(int(n), cfg.seed * 7919 + t) for t, n in enumerate(self.rows)],
            dtype=np.int64,
        )
        self._offsets = np.array(
            [int(_mix64(np.array([cfg.seed + 31 * t], dtype=_U64))[0] % _U64(n)) for t, n in enumerate(self.rows)],
            dtype=np.int64,
        )
        dense_rng = np.random.default_rng([cfg.seed, 99])
        self._dense_weights = dense_rng.standard_normal(cfg.num_dense_features) * (
            _DENSE_LOGIT_STD / math.sqrt(cfg.num_dense_features)
        )
        self._sparse_scale = _SPARSE_LOGIT_STD / math.sqrt(cfg.num_sparse_features)

    # --- sampling ------------------------------------------------------------------------------

    def _power_law_ids(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF of a power law with exponent s over [1, rows], as 0-based ranks."""
        s = self.cfg.zipf_exponent
        n = self.rows[None, :].astype(np.float64)
        if abs(s - 1.0) < 1e-9:
            x = np.exp(u * np.log(n + 1.0))
        else:
            x = (1.0 + u * ((n + 1.0) ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
        ranks = np.minimum(x.astype(np.int64) - 1, self.rows[None, :] - 1)
        ranks = np.maximum(ranks, 0)
        return (ranks * self._multipliers[None, :] + self._offsets[None, :]) % self.rows[None, :]

    def block(self, split: str, index: int) -> Batch:
        """Block ``index`` of ``split``: ``batch_size`` samples."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, SPLITS[split], index])
        b = cfg.batch_size
        ids = self._power_law_ids(rng.random((b, cfg.num_sparse_features)))
        dense = rng.standard_normal((b, cfg.num_dense_features)).astype(np.float32)
        logits = self._teacher(ids, dense)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
                lengths=torch.ones(b * cfg.num_sparse_features, dtype=torch.int32),
            ),
            labels=torch.from_numpy(labels),
        )

    def _teacher(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        sparse = np.zeros(ids.shape[0], dtype=np.float64)
        for t in range(ids.shape[1]):
            sparse += _hash_normal(self.cfg.seed, t, ids[:, t])
        return _BIAS + self._sparse_scale * sparse + dense.astype(np.float64) @ self._dense_weights

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """The hidden teacher's logits for a batch this class generated (on CPU)."""
        b = batch.labels.shape[0]
        ids = batch.sparse_features.values().cpu().numpy().reshape(-1, b).T
        dense = batch.dense_features.cpu().numpy()
        return torch.from_numpy(self._teacher(ids, dense).astype(np.float32))

    # --- iteration -----------------------------------------------------------------------------

    def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
        """This rank's training batches from ``start_step`` on, without end."""
        step = start_step
        while True:
            yield self.block("train", step * self.world_size + self.rank)
            step += 1

    def eval_batches(self, split: str, num_batches: int) -> Iterator[Batch]:
        """This rank's ``num_batches`` batches of the ``val`` or ``test`` split."""
        for i in range(num_batches):
            yield self.block(split, i * self.world_size + self.rank)
