"""The README's main job, as a user runs it: two trainers through `torchx run -s local_cwd`."""

import json
import os

from apps.dlrm.config import SYNTHETIC_STEPS
from tests.conftest import LOCAL_TRAIN_1X2, assert_ok, run

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"


def test_main_job_trains_a_sharded_dlrm_that_learns(tmp_path):
    out = tmp_path / "outputs"
    result = run(
        [
            *LOCAL_TRAIN_1X2,
            "--output_dir",
            str(out),
        ],
        cwd=str(tmp_path),  # any directory: the component and app come from the installed project
    )
    assert_ok(result)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == SYNTHETIC_STEPS == 1500  # synthetic data has no epochs
    # The defaults learn the hidden teacher to within 0.05 AUROC of the best possible.
    ceiling = summary["auroc_ceiling"]
    assert 0.75 < ceiling < 0.9
    assert summary["val_auroc"] >= ceiling - 0.05, summary
    assert summary["test_auroc"] >= ceiling - 0.05, summary
    assert summary["final_train_loss"] < 0.6
    assert summary["samples_per_sec"] > 0
    # the tables really were split over both ranks
    ranks = {line.rsplit(" ", 1)[-1] for line in summary["sharding_plan"]}
    assert {"0", "1"} <= set(",".join(ranks).split(","))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
