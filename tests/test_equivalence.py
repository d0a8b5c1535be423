"""Sharding changes where the tables live, not what is learned: 2 sharded ranks and one unsharded
process, from the same weights on the same samples and through the same kernels, follow the same
loss trajectory (benchmarks/equivalence.py, which the GPU check also runs). On a CPU it is the
same to the last bit, on any CPU: a difference, however small, is a bug in one of the two sides."""

import pytest

from benchmarks.equivalence import STEPS, compare

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
