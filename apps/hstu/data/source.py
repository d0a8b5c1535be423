"""What every sequence source shares: users' events (:class:`Events`), the leave-last-out split,
and the order of the batches (:class:`SequenceSource`).

Leave-last-out: a user's last event is the test target, the one before it the validation
target, and training reads the events before both. A batch is the events of ``batch_size``
users, each cut to its last ``--max_seq_len`` events (for evaluation: the target and the events
before it), with random negative items per user. Training step ``s`` on rank ``r`` of ``W``
reads block ``s * W + r`` of users, evaluation batch ``i`` block ``i * W + r``: every batch is a
pure function of (seed, step or batch, rank), so a resumed run reads exactly the batches an
uninterrupted one reads, and ranks never read the same users at once.

A population of known size (Parquet's users) is evaluated user by user once: ``--val_batches``
and ``--test_batches`` 0 mean all of it, and more batches than it fills are not read. The last
round's batches hold the users left; every rank still evaluates full batches (the sharded
model's collectives need every rank at each), filled up with users marked as padding
(``SequenceBatch.padding``), whose results the metrics leave out.
"""

from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from apps.core.data import DataSource, RankShare
from apps.core.zch.config import ZCH
from apps.hstu.config import HSTUModelConfig, SequenceDataConfig
from apps.hstu.data import random
from apps.hstu.data.batch import SequenceBatch

SPLITS = {"train": 0, "val": 1, "test": 2}
#: Events held out at the end of each user: the validation and the test target.
HELD_OUT = {"train": 2, "val": 1, "test": 0}
#: The fewest events a user needs: one to train on and the two targets.
MIN_EVENTS = 3
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Events:
    """Users' events, oldest first: jagged int64 ``items``, ``actions``, ``timestamps`` (seconds),
    ``lengths[u]`` of them for user ``u``."""

    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    lengths: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def window(self, users: torch.Tensor, drop_last: int, keep: int) -> "Events":
        """Users ``users``' events without their last ``drop_last``, of those the last ``keep``."""
        offsets = self.offsets
        ends = offsets[users + 1] - drop_last
        starts = torch.maximum(offsets[users], ends - keep)
        lengths = (ends - starts).clamp(min=0)
        index = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths)
        index = index + torch.arange(index.numel(), device=index.device)
        return Events(self.items[index], self.actions[index], self.timestamps[index], lengths)


class SequenceSource(DataSource[SequenceBatch]):
    """Batches of a population of users' events, leave-last-out, those ``share`` says this rank
    reads (a :class:`~apps.core.data.DataSource`, with what the HSTU's evaluation adds: the
    data's ceiling and action oracle, where known); subclasses say which users a training block
    holds (:meth:`train_users`) and make their events (:meth:`events`), on ``device``: the
    batches are made there, and every tensor that meets theirs is put there."""

    #: Steps of one pass over the training users; None for data that never repeats.
    steps_per_epoch: int | None = None
    #: The users evaluation reads, each once; None: a population without end (synthetic), whose
    #: evaluation reads as many batches as asked.
    num_users: int | None = None
    #: What a checkpoint records of the columns read (:class:`~apps.core.data.DataSource`):
    #: nothing, the model's inputs being items and actions.
    columns: dict[str, Any] | None = None

    def __init__(
        self, model: HSTUModelConfig, data: SequenceDataConfig, share: RankShare, device: torch.device = CPU
    ) -> None:
        self.model, self.data, self.share = model, data, share
        self.device = device

    def events(self, users: torch.Tensor) -> Events:
        """All events of ``users`` (indices into the population)."""
        raise NotImplementedError

    def train_users(self, block: int) -> torch.Tensor:
        """The users of training block ``block``."""
        raise NotImplementedError

    def eval_users(self, block: int) -> torch.Tensor:
        """The users of evaluation block ``block``: the population in order."""
        return block * self.share.batch_size + torch.arange(self.share.batch_size, device=self.device)

    def ceiling(self) -> dict[str, float] | None:
        """The best metrics any model can reach on this data, where known (synthetic data)."""
        return None

    def action_oracle(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Where the data's actions are drawn from a known law of the event's item (synthetic
        data), the function from items [n] to each action's probability [n, num_actions]: the
        Bayes-optimal ranking scores, whose AUROC is the ranking objective's ceiling."""
        return None

    def train_batches(self, start_step: int = 0) -> Generator[SequenceBatch, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        step = start_step
        while True:
            yield self.batch("train", self.share.block(step))
            step += 1

    def eval_batches(self, split: str, num_batches: int) -> Generator[SequenceBatch, None, None]:
        """This rank's ``num_batches`` batches of ``split`` ("val" or "test"), as many on every
        rank; of a population of ``num_users``, at most those that hold each user once (0: all)."""
        if self.num_users is not None:
            rounds = -(-self.num_users // self.share.global_batch)
            num_batches = min(num_batches, rounds) if num_batches else rounds
        for i in range(num_batches):
            yield self.batch(split, self.share.block(i))

    def batch(self, split: str, block: int) -> SequenceBatch:
        users = self.train_users(block) if split == "train" else self.eval_users(block)
        events = self.events(users).window(
            torch.arange(users.numel(), device=self.device), drop_last=HELD_OUT[split], keep=self.model.max_seq_len
        )
        padding = 0 if split == "train" else self._padding(block)
        return SequenceBatch.of(
            events.items,
            events.actions,
            events.timestamps,
            events.lengths,
            self._negatives(split, block, events),
            padding,
        )

    def _padding(self, block: int) -> int:
        """The last users of evaluation block ``block`` that lie past the population (its users
        from the start again): evaluated, so that every rank's batch is full, but not counted."""
        if self.num_users is None:
            return 0
        batch_size = self.share.batch_size
        return min(batch_size, max(0, (block + 1) * batch_size - self.num_users))

    def _negatives(self, split: str, block: int, events: Events) -> torch.Tensor:
        """[users, n] random items: --num_negatives for training (uniform over the items, or
        with zch over the batch's events); --eval_negatives for evaluation, uniform over the items
        other than the user's target (never with zch, which ranks among every item)."""
        users = events.lengths.numel()
        count = self.model.num_negatives if split == "train" else self.data.eval_negatives
        counters = torch.arange(users * count, device=self.device).view(users, count)
        key = torch.tensor(random.key(self.share.seed, 7 + SPLITS[split], block), device=self.device)
        draws = random.bits(key, counters)
        if split == "train" and self.data.categorical_ids == ZCH:
            # raw ids (zch): a random id is no item, the batch's events' items are (popular ones more often)
            return events.items[random.below(draws, events.items.numel())]
        if split == "train":
            return random.below(draws, self.model.num_items)
        targets = events.items[events.offsets[1:] - 1][:, None]
        others = random.below(draws, self.model.num_items - 1)
        return others + (others >= targets).long()
