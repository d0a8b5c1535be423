"""The equivalence check's data-parallel reference computes what FBGEMM's dense table kernel (the
kernel of data-parallel tables) computes, bit for bit: pooling and each row's gradient."""

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

from benchmarks.ordered_bags import OrderedEmbeddingBag, order_tables_as_fbgemm

# Tier (tests/conftest.py): pure logic in this process.
TIER = "unit"

ROWS, DIM, BAGS = 300, 16, 64


def jagged_batch(max_ids_per_bag: int, distinct_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids drawn from few rows (so rows repeat within and across bags) and their offsets; some
    bags empty when ``max_ids_per_bag`` allows it."""
    generator = torch.Generator().manual_seed(max_ids_per_bag)
    lengths = torch.randint(0 if max_ids_per_bag > 1 else 1, max_ids_per_bag + 1, (BAGS,), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.randint(0, distinct_ids, (int(offsets[-1]),), generator=generator), offsets


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("max_ids_per_bag, distinct_ids", [(1, 20), (12, 40)])
def test_pooling_and_gradients_equal_fbgemm_dense_kernel(mode, max_ids_per_bag, distinct_ids):
    ids, offsets = jagged_batch(max_ids_per_bag, distinct_ids)
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(BAGS, DIM, generator=torch.Generator().manual_seed(2))
    fbgemm = DenseTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM)], pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN, use_cpu=True
    )
    with torch.no_grad():
        fbgemm.weights.copy_(weight.flatten())
    expected = fbgemm(ids, offsets)
    expected.backward(grad)

    bag = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, include_last_offset=True)
    with torch.no_grad():
        bag.weight.copy_(weight)
    ordered = OrderedEmbeddingBag(bag)
    pooled = ordered(ids, offsets)
    pooled.backward(grad)

    assert torch.equal(pooled, expected)
    assert fbgemm.weights.grad is not None and bag.weight.grad is not None
    assert torch.equal(bag.weight.grad, fbgemm.weights.grad.view(ROWS, DIM))


def test_torch_embedding_bag_is_replaced_in_place_and_keeps_its_weights():
    module = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True))
    before = module.state_dict()
    order_tables_as_fbgemm(module)
    assert isinstance(module[0], OrderedEmbeddingBag)
    assert module.state_dict().keys() == before.keys()
    assert torch.equal(module.state_dict()["0.weight"], before["0.weight"])


@pytest.mark.parametrize(
    "bag", [torch.nn.EmbeddingBag(10, 4, mode="max", include_last_offset=True), torch.nn.EmbeddingBag(10, 4)]
)
def test_bags_it_cannot_compute_are_refused(bag):
    with pytest.raises(ValueError, match="only sum/mean bags with a last offset"):
        OrderedEmbeddingBag(bag)
