"""Training throughput of the HSTU app's layer stack (forward + backward) against a plain PyTorch
reference of the same layers written independently here, in the same run.

    python benchmarks/hstu_throughput.py                       # 32 users, up to 128 events, 2 layers
    python benchmarks/hstu_throughput.py --max_seq_len 512 --json hstu.json

Both sides compute HSTU layers (pointwise projection, SiLU attention with relative position and
time biases, causal, per user; Zhai et al. 2024) on the same users, whose lengths are uniform in
[--max_seq_len / 4, --max_seq_len]:

- ours: ``apps.hstu.modules.layer.HSTULayer`` on jagged tokens: the pointwise parts on the
  users' real tokens only, attention padded per batch (``--attention_kernel pytorch``);
- reference: every tensor padded to [users, longest, ...] from start to end (the dense way,
  written here from the paper's equations), the padding masked out of the attention.

The reference gets our layers' weights, and the outputs on the real tokens are compared first
(``max_abs_diff``): both sides compute the same function. Rates are real (non-padding) tokens and
users per second of wall time with ``--threads`` intra-op threads; the sides alternate, each
repeat timing ``--iters`` steps of each; medians of ``--repeats``; ``ratio`` is ours / reference.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.hstu.modules.attention import padded_attention  # noqa: E402
from apps.hstu.modules.jagged import JaggedLayout  # noqa: E402
from apps.hstu.modules.layer import HSTULayer  # noqa: E402
from benchmarks import cli  # noqa: E402


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--max_seq_len", type=int, default=128)
    parser.add_argument("--embedding_dim", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=2)
    parser.add_argument("--attention_dim", type=int, default=32)
    parser.add_argument("--linear_dim", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5, help="steps of each side per repeat")
    cli.add_repeats(parser, 5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    cli.add_json(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "hstu_throughput: --device cuda needs a CUDA GPU: use --device cpu\n")
    torch.set_num_threads(args.threads)
    figures = measure(args)
    print(
        f"ours     : {figures['ours_tokens_per_sec']:,.0f} tokens/s  {figures['ours_sequences_per_sec']:,.1f} sequences/s\n"
        f"reference: {figures['reference_tokens_per_sec']:,.0f} tokens/s  {figures['reference_sequences_per_sec']:,.1f} sequences/s\n"
        f"ratio (ours / padded dense reference): {figures['ratio']:.2f}  "
        f"({figures['tokens']} tokens of {figures['users']} users, {figures['padded_tokens']} padded; "
        f"max_abs_diff {figures['max_abs_diff']:.1e})"
    )
    cli.write_report(args.json, figures)


class ReferenceLayer(torch.nn.Module):
    """One HSTU layer on padded tensors [users, n, d], from the paper's equations."""

    def __init__(self, ours: HSTULayer, max_seq_len: int) -> None:
        super().__init__()
        self.ours = ours  # the weights only: every computation below is this class's own
        self.max_seq_len = max_seq_len

    def forward(self, x: torch.Tensor, times: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        w = self.ours
        users, n, _ = x.shape
        h, dl, da = w.num_heads, w.linear_dim, w.attention_dim
        normed = F.layer_norm(x, x.shape[-1:], w.input_norm.weight, w.input_norm.bias, w.input_norm.eps)
        projected = F.silu(normed @ w.uvqk.weight.T + w.uvqk.bias)
        u = projected[..., : h * dl]
        v = projected[..., h * dl : 2 * h * dl].reshape(users, n, h, dl).transpose(1, 2)
        q = projected[..., 2 * h * dl : 2 * h * dl + h * da].reshape(users, n, h, da).transpose(1, 2)
        k = projected[..., 2 * h * dl + h * da :].reshape(users, n, h, da).transpose(1, 2)
        i = torch.arange(n, device=x.device)
        distance = (i[:, None] - i[None, :]).clamp(0, w.bias.position.numel() - 1)
        elapsed = (times[:, :, None] - times[:, None, :]).clamp(min=0).double()
        buckets = torch.floor(torch.log2(elapsed + 1)).long().clamp(0, w.bias.time.numel() - 1)
        bias = w.bias.position[distance] + w.bias.time[buckets]  # [users, n, n]
        allowed = (i[:, None] >= i[None, :]) & valid[:, None, :] & valid[:, :, None]
        weights = torch.where(allowed[:, None], F.silu(q @ k.transpose(-1, -2) + bias[:, None]), 0.0)
        attended = (weights / self.max_seq_len) @ v  # [users, h, n, dl]
        attended = attended.transpose(1, 2).reshape(users, n, h * dl)
        normed_attention = F.layer_norm(
            attended, attended.shape[-1:], w.attention_norm.weight, w.attention_norm.bias, w.attention_norm.eps
        )
        return x + (normed_attention * u) @ w.output.weight.T + w.output.bias


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(1, args.max_seq_len // 4), args.max_seq_len + 1, (args.users,), generator=generator)
    layout = JaggedLayout.of(lengths.to(device))
    total = int(lengths.sum())
    x = torch.randn(total, args.embedding_dim, generator=generator).to(device).requires_grad_()
    gaps = torch.randint(0, 86_400, (total,), generator=generator).to(device)
    times = torch.cumsum(gaps, 0)  # growing within every user
    torch.manual_seed(args.seed)
    layers = [
        HSTULayer(
            args.embedding_dim,
            args.num_heads,
            args.attention_dim,
            args.linear_dim,
            args.max_seq_len,
            num_time_buckets=32,
            dropout=0.0,
            attention=padded_attention,
        ).to(device)
        for _ in range(args.num_layers)
    ]
    for layer in layers:
        torch.nn.init.normal_(layer.bias.position)
        torch.nn.init.normal_(layer.bias.time)
    references = [ReferenceLayer(layer, args.max_seq_len) for layer in layers]
    x_padded = layout.pad(x.detach()).requires_grad_()
    times_padded, valid = layout.pad(times), layout.valid()

    def ours() -> torch.Tensor:
        out = x
        for layer in layers:
            out = layer(out, times, layout)
        return out

    def reference() -> torch.Tensor:
        out = x_padded
        for layer in references:
            out = layer(out, times_padded, valid)
        return out

    max_abs_diff = float((layout.unpad(reference()) - ours()).abs().max().detach())
    sides = {"ours": ours, "reference": reference}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, step in sides.items():  # alternating: a slow moment of the machine hits both
            seconds[name].append(_time(step, args.iters, device))
    figures = {
        "device": args.device,
        "users": args.users,
        "tokens": total,
        "padded_tokens": args.users * layout.max_len,
        "max_seq_len": args.max_seq_len,
        "num_layers": args.num_layers,
        "embedding_dim": args.embedding_dim,
        "threads": args.threads,
        "repeats": args.repeats,
        "iters": args.iters,
        "max_abs_diff": max_abs_diff,
    }
    for name, samples in seconds.items():
        step = statistics.median(samples)
        figures[f"{name}_tokens_per_sec"] = total / step
        figures[f"{name}_sequences_per_sec"] = args.users / step
        figures[f"{name}_step_seconds"] = samples
    figures["ratio"] = figures["ours_tokens_per_sec"] / figures["reference_tokens_per_sec"]
    return figures


def _time(step, iters: int, device: torch.device) -> float:
    """Seconds per forward + backward step of ``step``."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step().square().mean().backward()
    _synchronize(device)
    return (time.perf_counter() - start) / iters


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
