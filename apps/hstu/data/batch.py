"""``SequenceBatch``: a batch of users' event sequences, as the HSTU model reads it.

Each user's events (oldest first) are one jagged row of the KeyedJaggedTensor ``features``:
feature ``item`` their item ids, ``action`` their action (event type) ids, and ``negative_item``
item ids that are not the user's events: random negatives for training, the candidates of
evaluation. ``timestamps`` are the events' times in seconds, aligned with ``item``'s values.

The model's embedding lookup runs on ``features``, an attribute of the batch, which is what
TorchRec's ``TrainPipelineSparseDist`` looks for to start the lookup's all-to-all a batch early.
"""

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from apps.core.common.kjt import sized_kjt

ITEM, ACTION, NEGATIVE = "item", "action", "negative_item"
#: The keys of ``SequenceBatch.features``, in order.
FEATURES = (ITEM, ACTION, NEGATIVE)


@dataclass
class SequenceBatch(Pipelineable):
    features: KeyedJaggedTensor
    timestamps: torch.Tensor
    #: The last users that only fill an evaluation batch up (evaluated, not counted): every rank
    #: evaluates full batches, however few users are left to evaluate.
    padding: int = 0

    @classmethod
    def of(
        cls,
        items: torch.Tensor,
        actions: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        negatives: torch.Tensor,
        padding: int = 0,
    ) -> "SequenceBatch":
        """The batch of users whose events are ``items``, ``actions``, ``timestamps`` (jagged
        values, int64) with ``lengths`` events each, and ``negatives`` [users, n] item ids; the
        last ``padding`` users are not counted."""
        users = lengths.numel()
        negative_lengths = torch.full((users,), negatives.shape[1], dtype=torch.int32, device=lengths.device)
        # The ids per feature are the tensors' sizes: the KJT need not read them from lengths.
        features = sized_kjt(
            list(FEATURES),
            values=torch.cat([items, actions, negatives.reshape(-1)]),
            lengths=torch.cat([lengths.int(), lengths.int(), negative_lengths]),
            per_key=[items.numel(), actions.numel(), negatives.numel()],
            stride=users,
        )
        return cls(features=features, timestamps=timestamps, padding=padding)

    @property
    def num_users(self) -> int:
        return self.features.stride()

    @property
    def counted(self) -> int:
        """The users whose results count (those before the padding)."""
        return self.num_users - self.padding

    def to(self, device: torch.device, non_blocking: bool = False) -> "SequenceBatch":
        return SequenceBatch(
            features=self.features.to(device=device, non_blocking=non_blocking),
            timestamps=self.timestamps.to(device=device, non_blocking=non_blocking),
            padding=self.padding,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)
        self.timestamps.record_stream(stream)

    def pin_memory(self) -> "SequenceBatch":
        return SequenceBatch(self.features.pin_memory(), self.timestamps.pin_memory(), self.padding)


def candidate_batch(items: torch.Tensor, num_users: int) -> KeyedJaggedTensor:
    """A lookup of ``items`` alone (feature ``negative_item``, all on the first user), the other
    features empty: how evaluation embeds every item through the same, possibly sharded, table."""
    lengths = torch.zeros(len(FEATURES) * num_users, dtype=torch.int32, device=items.device)
    lengths[2 * num_users] = items.numel()
    return sized_kjt(list(FEATURES), items, lengths, per_key=[0, 0, items.numel()], stride=num_users)
