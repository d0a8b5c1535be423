"""HSTU's pointwise aggregated attention, over each user's own tokens only:

    A(X) V,  A = SiLU(Q K^T + rab) / n  on positions j <= i of the same user, 0 elsewhere

(Zhai et al. 2024, eq. 2): a SiLU in place of the softmax, so a token's weights need not sum to 1
and the intensity of a user's history survives; ``n`` is a constant (the model's --max_seq_len),
so a token's output does not depend on how long the other users' sequences are.

Two kernels compute it (``--attention_kernel``): ``pytorch``, padded dense attention in plain
PyTorch on any device, and ``fused``, FBGEMM's HSTU kernel (``hstu_attn_varlen_func`` of FBGEMM's
experimental ``hstu`` package: CUDA only, built from source). fbgemm_gpu 1.8.0 as installed here
ships no HSTU kernel: its jagged attention operators (``torch.ops.fbgemm.sll_jagged_flash_attention_basic``,
``sll_multi_head_jagged_flash_attention``) compute softmax attention, a different function.
"""

import importlib
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from apps.core.common.errors import ConfigError
from apps.hstu.config import FUSED_NEEDS_CUDA
from apps.hstu.modules.jagged import JaggedLayout


class Attention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        layout: JaggedLayout,
        scale: float,
    ) -> torch.Tensor:
        """q, k [total, heads, attention_dim]; v [total, heads, linear_dim]; bias [users, max_len,
        max_len] (the relative position and time biases); returns [total, heads, linear_dim]."""
        ...


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, layout: JaggedLayout, scale: float
) -> torch.Tensor:
    """The plain-PyTorch kernel: each user's tokens padded to the longest, the padding and the
    future masked to 0 after the SiLU (a masked weight is exactly 0, not SiLU(-inf))."""
    qp, kp, vp = layout.pad(q), layout.pad(k), layout.pad(v)  # [users, len, heads, dim]
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) + bias[:, None]
    valid = layout.valid()
    causal = torch.ones(layout.max_len, layout.max_len, dtype=torch.bool, device=q.device).tril()
    mask = causal[None] & valid[:, None, :] & valid[:, :, None]
    weights = F.silu(scores) * (mask[:, None] * scale)
    return layout.unpad(torch.einsum("bhij,bjhd->bihd", weights, vp))


def fused_attention() -> Attention:
    """FBGEMM's HSTU kernel, or a ConfigError that says why it cannot run here."""
    if not torch.cuda.is_available():
        raise ConfigError(FUSED_NEEDS_CUDA)
    try:
        varlen = importlib.import_module("hstu").hstu_attn_varlen_func
    except (ImportError, AttributeError):
        raise ConfigError(
            "--attention_kernel fused needs FBGEMM's HSTU kernel (hstu_attn_varlen_func, package hstu from "
            "fbgemm_gpu/experimental/hstu), which is not installed; fbgemm_gpu itself ships none: "
            "install it, or use --attention_kernel pytorch"
        ) from None
    return _fbgemm_attention(varlen)


def _fbgemm_attention(varlen: Callable[..., torch.Tensor]) -> Attention:
    """FBGEMM's kernel behind the :class:`Attention` signature. Its SiLU is divided by the
    batch's longest sequence, ours by --max_seq_len, hence the rescaling; tests/unit/test_hstu_model.py
    compares it with :func:`padded_attention` on a GPU where the package is installed (it is on
    neither this project's CPU machines nor its lent GPU machines, so it has not run here)."""

    def attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, layout: JaggedLayout, scale: float
    ) -> torch.Tensor:
        offsets = layout.offsets.to(torch.int32)
        out = varlen(
            q,
            k,
            v,
            offsets,
            offsets,
            max_seqlen_q=layout.max_len,
            max_seqlen_k=layout.max_len,
            window_size=(-1, 0),  # causal
            rab=bias[:, None],
        )
        return out * (scale * layout.max_len)

    return attention


def attention_kernel(name: str) -> Attention:
    """The kernel of ``--attention_kernel``; refuses one that cannot run here."""
    return fused_attention() if name == "fused" else padded_attention
