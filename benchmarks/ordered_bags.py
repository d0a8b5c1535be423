"""Embedding bags in plain PyTorch whose every rounding is FBGEMM's: the tables of the
unsharded reference that ``benchmarks/equivalence.py`` trains.

Why not ``nn.EmbeddingBag``: a row hit by several samples of a batch gets the sum of their
gradients, and float32 sums depend on their order. FBGEMM's table kernels (every sharding type
runs them) accumulate a row's gradient one sample after the other, in the batch's order, as
``acc = fma(scale, grad, acc)`` with ``scale`` 1 (sum) or ``1/L`` (mean); torch's CPU
``embedding_bag`` backward uses another order, and which one depends on the CPU's vector
width. On an AVX-512 machine that left a few table elements one ulp apart after the first step,
and Adagrad's normalised updates carried the difference through ReLU kinks to 4e-4 in the loss
by step 17 -- the same for every sharding type, because it was the reference that differed.

Here each sum is written out in that order with elementwise operations only (IEEE-exact on any
CPU): the reference computes what FBGEMM computes, on every x86-64 machine, and the equivalence
check compares sharding and nothing else. The fused multiply-add of mean pooling is formed in
float64 (the product of two float32 is exact there) and rounded once to float32 -- where FBGEMM
fuses it: fbgemm-gpu-cpu 1.8.0 does, 1.6.0 (the GPU machine's row) rounds the product to float32
first. Which one a build does is measured, once, on its own kernel (``fbgemm_fuses_mean_grad``).
"""

import functools

import torch
from torch import nn


def _bag_of_each_id(offsets: torch.Tensor, num_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each id of a jagged batch: its bag, and its position inside that bag."""
    lengths = offsets.diff()
    bag = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return bag, torch.arange(num_ids) - offsets[bag]


def _occurrence(ids: torch.Tensor) -> torch.Tensor:
    """For each id, how many earlier entries of ``ids`` hold the same id (0 for its first)."""
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    run_start = torch.cummax(torch.where(starts, torch.arange(len(ids)), 0), dim=0).values
    occurrence = torch.empty_like(ids)
    occurrence[order] = torch.arange(len(ids)) - run_start
    return occurrence


class _OrderedBag(torch.autograd.Function):
    """Pooled lookups of one table; the table's gradient accumulated in the batch's order."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mean: bool) -> torch.Tensor:  # type: ignore[override]
        bag, position = _bag_of_each_id(offsets, len(ids))
        pooled = weight.new_zeros(len(offsets) - 1, weight.shape[1])
        for p in range(int(position.max()) + 1 if len(ids) else 0):
            at = position == p  # each bag once: no two writes to a row of ``pooled``
            pooled[bag[at]] += weight[ids[at]]
        scale = _scale(offsets, mean)
        ctx.save_for_backward(ids, bag, scale)
        ctx.num_rows, ctx.mean = weight.shape[0], mean
        return pooled * scale[:, None] if mean else pooled

    @staticmethod
    def backward(ctx, grad_pooled: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        ids, bag, scale = ctx.saved_tensors
        addend = scale.double()[bag, None] * grad_pooled.double()[bag]  # exact: two float32 factors
        if ctx.mean and not fbgemm_fuses_mean_grad():
            addend = addend.float().double()  # the product rounded to float32 before it is added
        grad = grad_pooled.new_zeros(ctx.num_rows, grad_pooled.shape[1])
        occurrence = _occurrence(ids)
        for k in range(int(occurrence.max()) + 1 if len(ids) else 0):
            at = occurrence == k  # each row once: its k-th sample, in the batch's order
            grad[ids[at]] = (grad[ids[at]].double() + addend[at]).float()
        return grad, None, None, None


@functools.cache
def fbgemm_fuses_mean_grad() -> bool:
    """Whether FBGEMM's CPU dense kernel adds a mean bag's ``grad * (1/L)`` to a row's gradient
    as one fused multiply-add (True), or rounds the product to float32 first (False).

    Measured on one row looked up three times by one bag: the three sums tell the two apart.
    Raises if the kernel matches neither, as the reference could then not equal it.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    dim = 64
    grad = torch.randn(1, dim, generator=torch.Generator().manual_seed(0))
    kernel = DenseTableBatchedEmbeddingBagsCodegen([(1, dim)], pooling_mode=PoolingMode.MEAN, use_cpu=True)
    with torch.enable_grad():  # off where the first backward asks
        kernel(torch.zeros(3, dtype=torch.long), torch.tensor([0, 3])).backward(grad)
    assert kernel.weights.grad is not None
    product = torch.tensor(1 / 3).double() * grad[0].double()  # exact: two float32 factors
    fused = rounded = torch.zeros(dim)
    for _ in range(3):
        fused, rounded = (fused.double() + product).float(), rounded + product.float()
    measured = kernel.weights.grad
    if not (torch.equal(measured, fused) or torch.equal(measured, rounded)):  # seed 0: the two differ
        raise RuntimeError(
            "FBGEMM's dense kernel adds a mean bag's gradient neither as one fused multiply-add nor "
            "with the product rounded first: benchmarks/ordered_bags.py cannot equal it (see its docstring)"
        )
    return torch.equal(measured, fused)


def _scale(offsets: torch.Tensor, mean: bool) -> torch.Tensor:
    """Per bag, the factor on its rows: 1, or 1/L as a float32 (an empty bag pools to zeros)."""
    lengths = offsets.diff().float()
    return 1.0 / lengths.clamp(min=1) if mean else torch.ones_like(lengths)


class OrderedEmbeddingBag(nn.Module):
    """Stands in for one of ``EmbeddingBagCollection``'s ``nn.EmbeddingBag`` (same parameter,
    same call), computing what FBGEMM computes."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        if bag.mode not in ("sum", "mean") or not bag.include_last_offset:
            raise ValueError(f"only sum/mean bags with a last offset are supported, not {bag.mode!r}")
        self.weight = bag.weight
        self.mean = bag.mode == "mean"

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if per_sample_weights is not None:
            raise ValueError("weighted bags are not supported")
        return _OrderedBag.apply(self.weight, input, offsets, self.mean)


def order_tables_as_fbgemm(model: nn.Module) -> None:
    """Replaces every ``nn.EmbeddingBag`` inside ``model`` by an ``OrderedEmbeddingBag`` that
    shares its weight (state-dict names, loading and optimizers are unchanged)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.EmbeddingBag):
                setattr(parent, name, OrderedEmbeddingBag(child))
