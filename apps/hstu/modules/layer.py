"""One HSTU layer (Zhai et al. 2024, eqs. 1-3) over jagged tokens:

    U, V, Q, K = split(SiLU(f1(LayerNorm(X))))            pointwise projection
    A V        = attention(Q, K, V, rab_position + rab_time)  (see :mod:`.attention`)
    Y          = X + Dropout(f2(LayerNorm(A V) * U))          pointwise transformation, residual

The relative attention bias ``rab`` is learned per layer: one weight per distance in positions
(i - j) and one per logarithmic bucket of the time between the two events (t_i - t_j seconds).
"""

import torch
import torch.nn.functional as F
from torch import nn

from apps.hstu.modules.attention import Attention
from apps.hstu.modules.jagged import JaggedLayout


class RelativeBias(nn.Module):
    """rab(i, j) = w_position[i - j] + w_time[bucket(t_i - t_j)] for the tokens of one user."""

    def __init__(self, max_seq_len: int, num_time_buckets: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.zeros(max_seq_len))
        self.time = nn.Parameter(torch.zeros(num_time_buckets))

    def forward(self, timestamps: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        """[users, max_len, max_len] biases for ``timestamps`` [total] (seconds, int64)."""
        positions = torch.arange(layout.max_len, device=timestamps.device)
        distance = (positions[:, None] - positions[None, :]).clamp(0, self.position.numel() - 1)
        times = layout.pad(timestamps)
        elapsed = (times[:, :, None] - times[:, None, :]).clamp(min=0)
        return self.position[distance][None] + self.time[time_bucket(elapsed, self.time.numel())]


def time_bucket(seconds: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """floor(log2(1 + seconds)), the last bucket taking everything longer: a minute and two
    minutes differ as much as a month and two months."""
    return torch.log2(seconds.double() + 1).long().clamp(0, num_buckets - 1)


class HSTULayer(nn.Module):
    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        attention_dim: int,
        linear_dim: int,
        max_seq_len: int,
        num_time_buckets: int,
        dropout: float,
        attention: Attention,
    ) -> None:
        super().__init__()
        self.num_heads, self.attention_dim, self.linear_dim = num_heads, attention_dim, linear_dim
        self.input_norm = nn.LayerNorm(embedding_dim)
        self.uvqk = nn.Linear(embedding_dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        self.bias = RelativeBias(max_seq_len, num_time_buckets)
        self.attention_norm = nn.LayerNorm(num_heads * linear_dim)
        self.output = nn.Linear(num_heads * linear_dim, embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.attention = attention
        # 1/n of the attention weights: the same n for every user and batch (see .attention).
        self.scale = 1.0 / max_seq_len

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        """``x`` [total, embedding_dim] jagged by ``layout``; returns the same shape."""
        h, dl, da = self.num_heads, self.linear_dim, self.attention_dim
        u, v, q, k = torch.split(F.silu(self.uvqk(self.input_norm(x))), [h * dl, h * dl, h * da, h * da], dim=-1)
        attended = self.attention(
            q.view(-1, h, da), k.view(-1, h, da), v.view(-1, h, dl), self.bias(timestamps, layout), layout, self.scale
        )
        return x + self.dropout(self.output(self.attention_norm(attended.reshape(-1, h * dl)) * u))
