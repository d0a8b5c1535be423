"""--categorical_ids zch end to end: a DLRM of TorchRec's managed-collision tables trained on raw ids
(50-bit integers and text) by 2 CPU ranks under torchrun, its id maps checkpointed with the tables,
resumed exactly, merged into 1 rank (evaluation, export), refused where they cannot go (split over
more ranks, a model of hashed ids), and its package mapping ids as the merged model does."""

import json
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
from testing.raw_ids import write_raw_id_parquet
from tests.conftest import assert_ok, run, torchrun_job
from tests.shards import saved_tensors

TIER = "integration"

ROWS, FILES, ROWS_PER_FILE = 16384, 4, 4096
ROWS_PER_TABLE = 512
MODEL = [
    "--num_dense_features", "2", "--num_sparse_features", "3", "--embedding_dim", "8",
    "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
    "--num_embeddings", str(ROWS_PER_TABLE), "--batch_size", "128",
    "--val_batches", "4", "--test_batches", "4", "--log_every", "20",
]  # fmt: skip
ZCH = ["--categorical_ids", "zch", "--checkpoint_every", "10"]
MAPS = "model.model.sparse_arch.embedding_bag_collection._managed_collision_collection._managed_collision_modules"


def train(tmp, name, data, *args, nproc=2):
    return torchrun_job(
        ["-m", "apps.dlrm.train", "--data", "parquet", "--data_path", data, *MODEL, *args], tmp / name, nproc=nproc
    )


def trained_run(tmp, options, steps):
    """``steps`` steps on 2 ranks with ``options`` over raw-id data written into ``tmp`` (3 columns
    of 3,000 raw ids each, one of text), checkpointing into ``tmp``/ckpt: (tmp, data, summary)."""
    data = str(tmp / "data")
    write_raw_id_parquet(data, rows=ROWS, files=FILES, distinct=3000)
    result, summary = train(tmp, "out", data, *options, "--steps", str(steps), "--checkpoint_dir", str(tmp / "ckpt"))
    assert_ok(result)
    return tmp, data, summary


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """40 steps of zch tables on 2 ranks, a checkpoint every 10 steps."""
    return trained_run(tmp_path_factory.mktemp("zch"), ZCH, 40)


def test_trains_row_wise_on_two_ranks_and_checkpoints_the_id_maps(trained):
    tmp, _, summary = trained
    assert summary["val_auroc"] > 0.7  # it learned the planted per-id effects
    step = tmp / "ckpt" / "step_00000040"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["model"]["categorical_ids"] == "zch" and manifest["model"]["zch_eviction_policy"] == "lfu"
    assert {s["type"] for s in manifest["sharding_plan"].values()} == {"row_wise"}
    for table in ("t_cat_0", "t_cat_1", "t_cat_2"):
        saved = saved_tensors(str(step), [f"{MAPS}.{table}._mch_sorted_raw_ids", f"{MAPS}.{table}._mch_counts"])
        ids = saved[f"{MAPS}.{table}._mch_sorted_raw_ids"]
        has_row = ids != torch.iinfo(torch.int64).max
        held = ids[has_row]
        # every rank's share full but for its last row (kept for ids without one): more ids were seen
        assert len(held) == ROWS_PER_TABLE - 2 and held.unique().numel() == len(held)
        assert held.min() >= 0 and held.max() < INPUT_HASH_SIZE  # hashed into TorchRec's input range
        assert (saved[f"{MAPS}.{table}._mch_counts"][has_row] > 0).all()  # LFU's counts of them


def test_resumes_exactly_where_it_stopped(trained, tmp_path):
    tmp, data, reference = trained
    ckpt = str(tmp_path / "ckpt")
    first, _ = train(tmp_path, "first", data, *ZCH, "--steps", "20", "--checkpoint_dir", ckpt)
    assert_ok(first)
    second, resumed = train(tmp_path, "second", data, *ZCH, "--steps", "40", "--checkpoint_dir", ckpt)
    assert_ok(second)
    assert resumed["resumed_from_step"] == 20
    assert resumed["final_train_loss"] == reference["final_train_loss"]  # bit for bit: the id maps came back
    assert resumed["val_auroc"] == reference["val_auroc"]


def test_one_rank_merges_the_two_ranks_maps_and_the_package_maps_ids_as_it_does(trained, tmp_path):
    tmp, data, summary = trained
    options = ["--data", "parquet", "--data_path", data, *MODEL, *ZCH, "--checkpoint_dir", str(tmp / "ckpt")]
    own = str(tmp_path / "own.npz")
    evaluation = [*options, "--test_batches", "0", "--output_dir", "", "--evaluate_checkpoint", "latest"]
    assert_ok(run([sys.executable, "-m", "testing.training_scores", "--out", own, *evaluation]))
    scores = np.load(own)
    # the merged model scores the test split as the 2 ranks did, but for the ids without a row: one
    # default row per rank there, the last rank's here
    assert abs(scores_auroc(scores["scores"], scores["labels"]) - summary["test_auroc"]) <= 0.02
    package = str(tmp_path / "package")
    export(ExportConfig(checkpoint_dir=str(tmp / "ckpt"), step="latest", output=package))
    manifest = json.loads((tmp_path / "package" / "manifest.json").read_text())
    assert manifest["features"]["categorical_ids"] == "zch" and "2**63 - 1" in manifest["features"]["id_transform"]
    test_rows = pq.read_table(f"{data}/day_{FILES - 1}.parquet").slice(ROWS_PER_FILE // 2)
    assert np.abs(load_model(package)(test_rows) - scores["scores"]).max() <= 1e-5  # row for row
    assert np.abs(load_model(str(tmp / "ckpt"), step="latest")(test_rows) - scores["scores"]).max() <= 1e-5
    int8 = str(tmp_path / "int8")  # the tables quantized, the id maps as they are
    export(ExportConfig(checkpoint_dir=str(tmp / "ckpt"), step="latest", output=int8, quantize="int8"))
    tables = json.loads((tmp_path / "int8" / "manifest.json").read_text())["tables"]
    assert tables["trained_bytes"] / tables["package_bytes"] >= 1.9
    labels = test_rows["label"].to_numpy()
    assert abs(scores_auroc(load_model(int8)(test_rows), labels) - scores_auroc(scores["scores"], labels)) <= 0.005


def test_a_checkpoint_is_not_split_over_more_ranks_than_wrote_it(trained, tmp_path):
    _, data, _ = trained
    ckpt = str(tmp_path / "ckpt")
    one, _ = train(tmp_path, "one", data, *ZCH, "--steps", "10", "--checkpoint_dir", ckpt, nproc=1)
    assert_ok(one)
    two, summary = train(tmp_path, "two", data, *ZCH, "--steps", "20", "--checkpoint_dir", ckpt)
    assert two.returncode != 0 and summary is None
    assert "written by 1 rank(s): their id-to-row state is split by id range per rank" in two.stderr


@pytest.mark.parametrize("ids", ["hash", "zch"])
def test_a_checkpoint_of_the_other_kind_of_ids_is_refused(trained, tmp_path, ids):
    tmp, data, _ = trained
    ckpt = str(tmp / "ckpt")
    if ids == "zch":  # a checkpoint of hashed ids, evaluated as zch
        ckpt = str(tmp_path / "hash")
        assert_ok(train(tmp_path, "hash", data, "--steps", "10", "--checkpoint_dir", ckpt, nproc=1)[0])
    options = ["--categorical_ids", ids, "--evaluate_checkpoint", "latest", "--checkpoint_dir", ckpt]
    result, _ = train(tmp_path, "evaluate", data, *options, nproc=1)
    assert result.returncode != 0
    assert "was written for another model (categorical_ids:" in result.stderr
