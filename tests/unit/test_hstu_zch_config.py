"""--categorical_ids zch's options for the HSTU: what is refused in one line naming the option, and
what a checkpoint of managed-collision tables records (so that one of plain tables is refused)."""

import pytest

from apps.core.common.errors import ConfigError
from apps.hstu.config import train_config

TIER = "unit"


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"eval_negatives": 10}, "--eval_negatives 10 draws random item ids, which are no items"),
        ({"num_items": 1, "synthetic_branching": 1}, "--num_items 1 (table 0) is too small for --categorical_ids zch"),
        ({"sharding_type": "column_wise"}, "--sharding_type column_wise: TorchRec shards managed-collision"),
        (
            {"checkpoint_dir": "/tmp/c", "checkpoint_every": 10, "zch_eviction_interval": 4},
            "--checkpoint_every 10 is not a multiple of --zch_eviction_interval 4",
        ),
        ({"zch_eviction_policy": "fifo"}, "zch_eviction_policy"),
    ],
)
def test_what_managed_collision_items_cannot_run_is_refused_in_one_line(options, refusal):
    with pytest.raises((ConfigError, ValueError)) as refused:
        train_config(categorical_ids="zch", **options)
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_the_checkpoints_signature_names_the_ids_and_the_policy():
    assert "categorical_ids" not in train_config().model_signature()
    signature = train_config(categorical_ids="zch", zch_eviction_policy="lru").model_signature()
    assert signature["categorical_ids"] == "zch" and signature["zch_eviction_policy"] == "lru"
