"""Sharding changes where the tables live, not what is learned: 2 sharded ranks and one unsharded
process (the DLRM's and the HSTU's), from the same weights on the same samples and through the same kernels, follow the same
loss trajectory (benchmarks/equivalence.py, which the GPU check also runs). On a CPU it is the
same to the last bit, on any CPU: a difference, however small, is a bug in one of the two sides."""

import pytest

from apps.dlrm.data.criteo.tables import MLPERF_MULTI_HOT_SIZES
from benchmarks.equivalence import APPS, STEPS, compare, compare_types

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

WORLD = 2


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_sharded_training_matches_unsharded_reference(sharding_type, tmp_path):
    result = compare(sharding_type, WORLD, str(tmp_path))
    assert set(result.plan) == {sharding_type}
    assert len(result.sharded) == STEPS
    assert result.sharded == result.reference, [a - b for a, b in zip(result.sharded, result.reference)]
    assert result.learning
    assert result.equal


def test_sharded_hstu_matches_unsharded_reference_for_every_sharding_type_it_admits(tmp_path):
    """One torchrun for every type (the HSTU's ranks keep each user block's in-batch negatives,
    which the reference must do too: a difference there shows at the first step)."""
    results = compare_types(list(APPS["hstu"].sharding_types), WORLD, str(tmp_path), app="hstu")
    assert [r.sharding_type for r in results] == ["table_wise", "row_wise", "column_wise"]
    for result in results:
        assert set(result.plan) == {result.sharding_type}
        assert len(result.sharded) == STEPS
        assert result.sharded == result.reference, (result.sharding_type, result.max_difference)
        assert result.learning, result.reference


@pytest.mark.parametrize("options", [{}, dict(multi_hot_sizes=MLPERF_MULTI_HOT_SIZES, pooling="mean")])
def test_one_ranks_lean_and_sharded_steps_both_match_unsharded_reference(options, tmp_path):
    """On one rank the lean step (the tables' FBGEMM kernels called directly, no all-to-alls, no
    DDP) and TorchRec's sharded step (--lean_step false) train to the same losses, bit for bit,
    as the unsharded reference: one-hot ids summed, multi-hot ids averaged."""
    kinds = ["table_wise", "data_parallel"]
    lean = compare_types(kinds, 1, str(tmp_path), **options)
    sharded = compare_types(kinds, 1, str(tmp_path), lean_step="false", **options)
    for kind, lean_result, sharded_result in zip(kinds, lean, sharded):
        assert (lean_result.lean, sharded_result.lean) == (True, False), kind
        assert set(lean_result.plan) == set(sharded_result.plan) == {kind}
        assert lean_result.sharded == sharded_result.sharded == lean_result.reference, kind
        assert len(lean_result.sharded) == STEPS and lean_result.learning, kind
