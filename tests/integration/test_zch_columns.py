"""--zch_columns end to end: a DLRM whose named raw-id columns are TorchRec managed-collision tables
(row-wise) while the other column stays a hashed table (table_wise), trained by 2 CPU ranks under
torchrun with evictions, resumed exactly, merged into 1 rank, exported and scored as the merged
model scores, and refused where the managed columns differ from the checkpoint's."""

import json
import shutil
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.zch.config import INPUT_HASH_SIZE
from apps.dlrm.serving.api import load_model
from apps.dlrm.serving.config import ExportConfig
from apps.dlrm.serving.export import export
from testing.click_parquet import scores_auroc
from tests.conftest import assert_ok, run
from tests.integration.test_zch import FILES, MODEL, ROWS_PER_FILE, ROWS_PER_TABLE, train, trained_run
from tests.shards import saved_tensors

TIER = "integration"

#: cat_0 (50-bit integers) and cat_2 (text) managed, cat_1 hashed into its table, placed whole on a rank.
MIXED = [
    "--sparse_columns", "cat_0,cat_1,cat_2", "--zch_columns", "cat_0,cat_2",
    "--sharding_type", "table_wise", "--checkpoint_every", "10",
]  # fmt: skip
MAPS = "model.model.sparse_arch.managed_collection._managed_collision_collection._managed_collision_modules"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """20 steps on 2 ranks, a checkpoint every 10 steps."""
    return trained_run(tmp_path_factory.mktemp("zch_columns"), MIXED, 20)


def test_the_named_columns_are_managed_row_wise_the_other_hashed_table_wise(trained):
    tmp, _, summary = trained
    assert summary["val_auroc"] > 0.65  # it learns the planted per-id effects
    manifest = json.loads((tmp / "ckpt" / "step_00000020" / "manifest.json").read_text())
    assert manifest["model"]["zch_features"] == [0, 2]
    plan = manifest["sharding_plan"]
    assert plan["t_cat_1"]["type"] == "table_wise" and len(plan["t_cat_1"]["ranks"]) == 1
    assert plan["t_cat_0"]["type"] == plan["t_cat_2"]["type"] == "row_wise"
    for table in ("t_cat_0", "t_cat_2"):
        ids = saved_tensors(str(tmp / "ckpt" / "step_00000020"), [f"{MAPS}.{table}._mch_sorted_raw_ids"])
        held = next(iter(ids.values()))
        held = held[held != torch.iinfo(torch.int64).max]
        # evictions ran: every rank's share full but for its last row, of ids in TorchRec's input range
        assert len(held) == ROWS_PER_TABLE - 2 and held.max() < INPUT_HASH_SIZE


def test_resumes_exactly_where_it_stopped(trained, tmp_path):
    _, data, reference = trained
    ckpt = str(tmp_path / "ckpt")
    assert_ok(train(tmp_path, "first", data, *MIXED, "--steps", "10", "--checkpoint_dir", ckpt)[0])
    second, resumed = train(tmp_path, "second", data, *MIXED, "--steps", "20", "--checkpoint_dir", ckpt)
    assert_ok(second)
    assert resumed["resumed_from_step"] == 10
    assert resumed["final_train_loss"] == reference["final_train_loss"]  # bit for bit: both collections came back
    assert resumed["val_auroc"] == reference["val_auroc"]


def test_one_rank_merges_it_and_the_package_maps_ids_as_it_does(trained, tmp_path):
    tmp, data, summary = trained
    ckpt = str(tmp / "ckpt")
    own = str(tmp_path / "own.npz")
    options = ["--data", "parquet", "--data_path", data, *MODEL, *MIXED, "--checkpoint_dir", ckpt]
    evaluation = [*options, "--test_batches", "0", "--output_dir", "", "--evaluate_checkpoint", "latest"]
    assert_ok(run([sys.executable, "-m", "testing.training_scores", "--out", own, *evaluation]))
    scores = np.load(own)
    # as the 2 ranks scored the test split, but for the ids without a row (one default row per rank there)
    assert abs(scores_auroc(scores["scores"], scores["labels"]) - summary["test_auroc"]) <= 0.02
    package = str(tmp_path / "package")
    export(ExportConfig(checkpoint_dir=ckpt, step="latest", output=package))
    features = json.loads((tmp_path / "package" / "manifest.json").read_text())["features"]
    assert features["zch_features"] == [0, 2] and features["id_transform"].startswith("cat_0, cat_2 (--zch_columns)")
    test_rows = pq.read_table(f"{data}/day_{FILES - 1}.parquet").slice(ROWS_PER_FILE // 2)
    assert np.abs(load_model(package)(test_rows) - scores["scores"]).max() <= 1e-5  # row for row
    assert np.abs(load_model(ckpt, step="latest")(test_rows) - scores["scores"]).max() <= 1e-5


def test_three_ranks_take_the_two_ranks_checkpoint_on(trained, tmp_path):
    """The managed tables' id maps split over more ranks than wrote them, the hashed table placed
    anew: training goes on from the checkpoint."""
    _, data, reference = trained
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(trained[0] / "ckpt", ckpt)  # the fixture's stays as it was for the other tests
    result, resumed = train(tmp_path, "three", data, *MIXED, "--steps", "30", "--checkpoint_dir", ckpt, nproc=3)
    assert_ok(result)
    assert resumed["resumed_from_step"] == 20 and resumed["steps"] == 30
    assert "managed-collision tables t_cat_0, t_cat_2: each rank took the ids of its id range from the 2 saved" in (
        result.stdout + result.stderr
    )
    assert resumed["final_train_loss"] < reference["final_train_loss"]


@pytest.mark.parametrize(
    "ids",
    [
        ["--zch_columns", "cat_0"],
        ["--zch_columns", ""],
        ["--categorical_ids", "zch", "--zch_columns", "", "--sharding_type", "row_wise"],
    ],
    ids=["fewer", "hash", "zch"],
)
def test_other_managed_columns_than_the_checkpoints_are_refused(trained, tmp_path, ids):
    tmp, data, _ = trained
    options = [*MIXED, *ids, "--evaluate_checkpoint", "latest", "--checkpoint_dir", str(tmp / "ckpt")]
    result, _ = train(tmp_path, "evaluate", data, *options, nproc=1)
    assert result.returncode != 0
    assert "was written for another model (" in result.stderr and "zch_features" in result.stderr


def test_a_column_a_pattern_matches_is_managed_and_the_checkpoint_exports_without_the_files(trained, tmp_path):
    """--sparse_columns 'cat_*' --zch_columns cat_2: the trainer places cat_2 by the files' columns,
    the checkpoint records it, and its export (the files gone) builds the same model."""
    data = tmp_path / "data"
    shutil.copytree(trained[1], data)
    ckpt = tmp_path / "ckpt"
    options = ["--sparse_columns", "cat_*", "--zch_columns", "cat_2", "--checkpoint_every", "10"]
    result, _ = train(tmp_path, "out", str(data), *options, "--steps", "10", "--checkpoint_dir", str(ckpt), nproc=1)
    assert_ok(result)
    manifest = json.loads((ckpt / "step_00000010" / "manifest.json").read_text())
    assert manifest["model"]["zch_features"] == [2]
    assert manifest["sharding_plan"]["t_cat_2"]["type"] == "row_wise"
    shutil.rmtree(data)  # the export reads the checkpoint only
    export(ExportConfig(checkpoint_dir=str(ckpt), step="latest", output=str(tmp_path / "package")))
    features = json.loads((tmp_path / "package" / "manifest.json").read_text())["features"]
    assert features["zch_features"] == [2]
