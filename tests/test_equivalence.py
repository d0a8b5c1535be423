"""Sharding changes where the tables live, not what is learned: 2 sharded ranks and one plain
unsharded process, from the same weights on the same samples, follow the same loss trajectory
(benchmarks/equivalence.py, which the GPU check also runs)."""

import pytest

from benchmarks.equivalence import STEPS, TOLERANCE, compare

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

WORLD = 2


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_sharded_training_matches_unsharded_reference(sharding_type, tmp_path):
    result = compare(sharding_type, WORLD, str(tmp_path))
    assert set(result.plan) == {sharding_type}
    assert len(result.sharded) == STEPS
    assert result.sharded == pytest.approx(result.reference, abs=TOLERANCE), (result.sharded, result.reference)
    assert result.reference[-1] < result.reference[0]  # and it is actually learning
    assert result.equal
