"""Jagged sequences: the tokens of all users back to back (``values`` [total, ...]) and where each
user's start (``offsets`` [users + 1]), as TorchRec's ``JaggedTensor`` holds them.

Pointwise layers run on the values directly; attention needs each user's tokens side by side, so
the plain-PyTorch path pads them into [users, longest, ...] and back. The padding never mixes into
a result: attention masks it out, and :meth:`JaggedLayout.unpad` drops it.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class JaggedLayout:
    """Where each token of a jagged batch sits: its user, its position within the user's
    sequence, and its place in the padded [users, max_len] grid."""

    offsets: torch.Tensor  # [users + 1], int64
    users: torch.Tensor  # [total]: the user of each token
    positions: torch.Tensor  # [total]: the token's position in its user's sequence, from 0
    max_len: int

    @classmethod
    def of(cls, lengths: torch.Tensor) -> "JaggedLayout":
        lengths = lengths.long()
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
        offsets[1:] = torch.cumsum(lengths, 0)
        users = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        positions = torch.arange(users.numel(), device=lengths.device) - offsets[:-1][users]
        max_len = int(lengths.max()) if lengths.numel() else 0
        return cls(offsets, users, positions, max_len)

    @property
    def num_users(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def grid_index(self) -> torch.Tensor:
        """Each token's row in the padded grid flattened to [users * max_len]."""
        return self.users * self.max_len + self.positions

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """[total, ...] -> [users, max_len, ...], zeros where a user has no token."""
        grid = values.new_zeros((self.num_users * self.max_len, *values.shape[1:]))
        grid = grid.index_copy(0, self.grid_index, values)
        return grid.view(self.num_users, self.max_len, *values.shape[1:])

    def unpad(self, grid: torch.Tensor) -> torch.Tensor:
        """[users, max_len, ...] -> [total, ...]: the tokens' rows, padding dropped."""
        return grid.reshape(self.num_users * self.max_len, *grid.shape[2:])[self.grid_index]

    def valid(self) -> torch.Tensor:
        """[users, max_len] booleans: True where a user has a token."""
        positions = torch.arange(self.max_len, device=self.offsets.device)
        return positions[None, :] < self.lengths[:, None]

    def first_tokens(self) -> torch.Tensor:
        """[total] booleans: True at each user's first token."""
        return self.positions == 0

    def last_index(self, back: int = 1) -> torch.Tensor:
        """[users]: the index in ``values`` of each user's ``back``-th token from the end."""
        return self.offsets[1:] - back
