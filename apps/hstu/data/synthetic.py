"""Synthetic users whose next item follows a hidden item-transition process with a known ceiling.

Every item ``i`` has ``K`` successors (``--synthetic_branching``) with weights halving
(w_m proportional to 2**-m). A user's first item is uniform over the ``N`` items; each next item is,
with probability ``1 - noise`` (``--synthetic_noise``), the m-th successor of the current item
drawn with weight w_m, else uniform over all items. So

    P(next = j | current = i) = (1 - noise) * w_m * [j is successor m of i] + noise / N

and the Bayes-optimal next-item predictor ranks the successors of the last item by weight, then
the other items in a random order. :meth:`TransitionProcess.ceiling` computes that predictor's
HR@K, NDCG@K and MRR exactly (no sampling) for the evaluation's candidates: all items, or the
target and ``n`` uniform negatives. No model can do better in expectation.

Each event's action is drawn from a softmax over the actions of pseudo-random per-(item, action)
logits (what a ranking model can learn from the item); times grow by exponential gaps (mean an
hour). A user's events are a pure function of (seed, user index): training reads users
``k * batch_size ...`` of block ``k`` (a stream that never repeats), and evaluation the first
users of that stream, whose earlier events training has seen, as leave-last-out means.

With ``--categorical_ids zch`` item ``i``'s id is a raw one, ``i`` hashed into the managed-collision
table's input range (:func:`apps.core.zch.ids.input_ids`), as the Parquet reader hashes a file's.
"""

import math
from typing import Callable

import numpy as np
import torch

from apps.core.data import RankShare
from apps.core.zch.config import ZCH
from apps.core.zch.ids import input_ids
from apps.hstu.config import HSTUModelConfig, SequenceDataConfig
from apps.hstu.data import random
from apps.hstu.data.source import Events, SequenceSource

#: Independent random streams of a user's events.
_LENGTH, _FIRST, _FOLLOW, _SUCCESSOR, _NOISE, _ACTION, _GAP = range(7)
_STREAM_SHIFT = 32  # a user may have up to 2**32 events per stream
_ACTION_LOGIT_STD = 2.0
_MEAN_GAP_SECONDS = 3600.0
_FIRST_TIME = 1_700_000_000
CPU = torch.device("cpu")


class TransitionProcess:
    """The hidden next-item process: successors, their weights, and the exact ceiling.

    What drawing events reads (the successors, the weights' cumulative sums, the actions' key)
    is on ``device``, where the users are generated; the ceiling's exact arithmetic is on the CPU.
    """

    def __init__(
        self, num_items: int, num_actions: int, branching: int, noise: float, seed: int, device: torch.device = CPU
    ) -> None:
        self.num_items, self.num_actions, self.branching, self.noise = num_items, num_actions, branching, noise
        self.seed = seed
        items = torch.arange(num_items, device=device)
        start = random.below(random.bits(torch.tensor(random.key(seed, 1), device=device), items), num_items)
        # successors spaced N // K apart: K distinct items for every K <= N
        self.successors = (
            start[:, None] + torch.arange(branching, device=device) * (num_items // branching)
        ) % num_items
        halving = 0.5 ** torch.arange(branching, dtype=torch.float64)
        self.weights = halving / halving.sum()
        self._cumulative = torch.cumsum(self.weights, 0).to(device)
        self._action_key = torch.tensor(random.key(seed, 2), device=device)

    def next_items(
        self, current: torch.Tensor, follow: torch.Tensor, pick: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """The next item after ``current``, from three random bit tensors of its shape."""
        m = torch.searchsorted(self._cumulative, random.uniform(pick)).clamp(max=self.branching - 1)
        followed = self.successors[current, m]
        return torch.where(random.uniform(follow) < 1 - self.noise, followed, random.below(noise, self.num_items))

    def transition_probabilities(self, current: torch.Tensor) -> torch.Tensor:
        """[len(current), N] P(next = j | current), float64: what the Bayes-optimal predictor scores."""
        device = self.successors.device
        p = torch.full(
            (current.numel(), self.num_items), self.noise / self.num_items, dtype=torch.float64, device=device
        )
        successor_p = ((1 - self.noise) * self.weights).to(device).expand(current.numel(), -1)
        p.scatter_add_(1, self.successors[current], successor_p)
        return p

    def action_logits(self, items: torch.Tensor) -> torch.Tensor:
        """[len(items), A] the logits each event's action is drawn from (``items`` on the process's device)."""
        counters = items[:, None] * self.num_actions + torch.arange(self.num_actions, device=items.device)
        return _ACTION_LOGIT_STD * random.normal(random.bits(self._action_key, counters))

    def ceiling(self, negatives: int, k: int = 10) -> dict[str, float]:
        """The Bayes-optimal predictor's expected HR@k, NDCG@k and MRR, ranking the target among
        all items (``negatives`` 0) or among itself and ``negatives`` uniform other items
        (ties, among items the process finds equally likely, broken at random)."""
        pmf = self.rank_distribution(negatives)
        ranks = torch.arange(1, pmf.numel() + 1, dtype=torch.float64)
        top = ranks <= k
        return {
            f"hr@{k}": float(pmf[top].sum()),
            f"ndcg@{k}": float((pmf[top] / torch.log2(ranks[top] + 1)).sum()),
            "mrr": float((pmf / ranks).sum()),
        }

    def rank_distribution(self, negatives: int) -> torch.Tensor:
        """P(rank = r), r = 1, 2, ..., of the target under the Bayes-optimal predictor."""
        n_items, k, noise = self.num_items, self.branching, self.noise
        successor_p = (1 - noise) * self.weights + noise / n_items  # the target is successor m, ranked m-th
        other_p = noise * (n_items - k) / n_items  # the target is another item, tied with all others
        if negatives == 0:
            pmf = torch.full((n_items,), noise / n_items, dtype=torch.float64)  # uniform over ranks k+1..N
            pmf[:k] = successor_p
            return pmf
        pmf = torch.zeros(negatives + 1, dtype=torch.float64)
        others = n_items - 1
        for m in range(k):  # successor m+1 is beaten by each negative that is one of the m above it
            pmf += successor_p[m] * _binomial(negatives, m / others)
        if k < n_items:
            pmf += other_p * _beaten_or_tied(negatives, k / others, (n_items - k - 1) / others)
        return pmf


def _binomial(n: int, p: float) -> torch.Tensor:
    counts = torch.arange(n + 1, dtype=torch.float64)
    if p <= 0:
        return (counts == 0).double()
    if p >= 1:
        return (counts == n).double()
    return torch.exp(_log_choose(n, counts) + counts * math.log(p) + (n - counts) * math.log1p(-p))


def _log_choose(n: int | torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    n = torch.as_tensor(n, dtype=torch.float64)
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def _beaten_or_tied(n: int, better: float, tied: float) -> torch.Tensor:
    """P(rank = r) of a target that each of ``n`` negatives independently beats with probability
    ``better`` and ties with probability ``tied``; a tie is broken at random, so with ``b``
    better and ``t`` tied negatives the rank is uniform over 1 + b ... 1 + b + t."""
    worse = 1 - better - tied
    b = torch.arange(n + 1, dtype=torch.float64)[:, None]
    t = torch.arange(n + 1, dtype=torch.float64)[None, :]
    rest = n - b - t
    valid = rest >= 0
    log_p = (
        torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64))
        - torch.lgamma(b + 1)
        - torch.lgamma(t + 1)
        - torch.lgamma(rest.clamp(min=0) + 1)
        + torch.xlogy(b, torch.tensor(better, dtype=torch.float64))  # 0 * log 0 = 0: a count of 0 has probability 1
        + torch.xlogy(t, torch.tensor(tied, dtype=torch.float64))
        + torch.xlogy(rest.clamp(min=0), torch.tensor(max(worse, 0.0), dtype=torch.float64))
    )
    mass = torch.where(valid, torch.exp(log_p), 0.0) / (t + 1)  # per rank of the t + 1 it is uniform over
    spread = torch.zeros(n + 2, dtype=torch.float64)  # difference array over ranks 1 + b ... 1 + b + t
    bi, ti = torch.broadcast_tensors(b.long(), t.long())
    spread.index_add_(0, bi.reshape(-1), mass.reshape(-1))
    spread.index_add_(0, (bi + ti + 1).clamp(max=n + 1).reshape(-1), -mass.reshape(-1))
    return torch.cumsum(spread, 0)[: n + 1]


class SyntheticSequences(SequenceSource):
    """Users of the hidden :class:`TransitionProcess`, generated on the fly on ``device``."""

    def __init__(
        self, model: HSTUModelConfig, data: SequenceDataConfig, share: RankShare, device: torch.device = CPU
    ) -> None:
        super().__init__(model, data, share, device)
        self.process = TransitionProcess(
            model.num_items, model.num_actions, data.synthetic_branching, data.synthetic_noise, share.seed, device
        )
        self._user_key = random.key(share.seed, 3)
        #: With zch, item i's raw id (else None: ids are the items), and the raw ids sorted with
        #: their items, to find the item of an id.
        self._raw_ids: torch.Tensor | None = None
        if data.categorical_ids == ZCH:
            raw = torch.from_numpy(input_ids(np.arange(model.num_items))).to(device)
            self._raw_ids = raw
            self._sorted_raw_ids, self._items_of_sorted = torch.sort(raw)

    def train_users(self, block: int) -> torch.Tensor:
        return self.eval_users(block)  # the stream of users, each read once

    def ceiling(self) -> dict[str, float]:
        return self.process.ceiling(self.data.eval_negatives)

    def action_oracle(self) -> Callable[[torch.Tensor], torch.Tensor]:
        # Probabilities, not the logits: whether action a is taken depends on every action's logit.
        return lambda items: torch.softmax(self.process.action_logits(self._items_of(items)), dim=-1)

    def _items_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The items whose ids are ``ids``."""
        if self._raw_ids is None:
            return ids
        return self._items_of_sorted[torch.searchsorted(self._sorted_raw_ids, ids)]

    def events(self, users: torch.Tensor) -> Events:
        """Users ``users``' events: from ``--synthetic_min_events`` to ``--max_seq_len + 2`` each."""
        users = users.to(self.device)
        keys = random.bits(torch.tensor(self._user_key, device=self.device), users)[:, None]
        low, high = self.data.synthetic_min_events, self.model.max_seq_len + 2
        lengths = low + random.below(self._stream(keys, _LENGTH, 1)[:, 0], high - low + 1)
        steps = int(lengths.max())
        follow, pick, noise = (self._stream(keys, s, steps) for s in (_FOLLOW, _SUCCESSOR, _NOISE))
        current = random.below(self._stream(keys, _FIRST, 1)[:, 0], self.model.num_items)
        items = [current]
        for t in range(1, steps):
            current = self.process.next_items(current, follow[:, t], pick[:, t], noise[:, t])
            items.append(current)
        item_grid = torch.stack(items, 1)
        gumbel = -torch.log(-torch.log(random.uniform(self._stream(keys, _ACTION, steps * self.model.num_actions))))
        logits = self.process.action_logits(item_grid.reshape(-1)).view(len(users), steps, -1)
        action_grid = (logits + gumbel.view(len(users), steps, -1)).argmax(-1)
        gaps = (-_MEAN_GAP_SECONDS * torch.log(random.uniform(self._stream(keys, _GAP, steps)))).long()
        time_grid = _FIRST_TIME + torch.cumsum(gaps, 1)
        valid = torch.arange(steps, device=self.device)[None, :] < lengths[:, None]
        ids = item_grid[valid] if self._raw_ids is None else self._raw_ids[item_grid[valid]]
        return Events(ids, action_grid[valid], time_grid[valid], lengths)

    def _stream(self, keys: torch.Tensor, stream: int, count: int) -> torch.Tensor:
        counters = torch.arange(count, device=self.device)[None, :] + (stream << _STREAM_SHIFT)
        return random.bits(keys, counters)
