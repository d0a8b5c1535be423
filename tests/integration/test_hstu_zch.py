"""HSTU's item table with --categorical_ids zch end to end: TorchRec's managed-collision
``EmbeddingCollection`` trained by 2 CPU ranks under torchrun on synthetic users (their items hashed
into raw ids) and on a Parquet file of 64-bit item ids, learning far above chance; its id map
checkpointed with the table and resumed to the very results of an uninterrupted run; a checkpoint
of the other kind of ids refused."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.zch.config import INPUT_HASH_SIZE
from apps.core.zch.ids import input_ids
from tests.conftest import assert_ok, torchrun_job
from tests.shards import saved_tensors

TIER = "integration"

ITEMS, STEPS, RESUMED_AT = 500, 60, 30
MODEL = [
    "--num_items",
    str(ITEMS),
    "--batch_size",
    "64",
    "--val_batches",
    "2",
    "--test_batches",
    "2",
    "--log_every",
    "20",
]
ZCH = ["--categorical_ids", "zch", "--checkpoint_every", str(RESUMED_AT)]
MAP = "model.model.embedding_collection._managed_collision_collection._managed_collision_modules.item_table"


def train(tmp, name, *args, nproc=2):
    return torchrun_job(["-m", "apps.hstu.train", *MODEL, *args], tmp / name, nproc=nproc)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """60 steps of synthetic users (500 items) with a managed-collision item table on 2 ranks, a
    checkpoint every 30 steps."""
    tmp = tmp_path_factory.mktemp("hstu_zch")
    result, summary = train(tmp, "out", *ZCH, "--steps", str(STEPS), "--checkpoint_dir", str(tmp / "ckpt"))
    assert_ok(result)
    return tmp, summary


def test_learns_and_checkpoints_the_id_map(trained):
    tmp, summary = trained
    # ranked among the ~500 items with rows: chance is 10 / 500 = 0.02
    assert summary["val_hr@10"] > 0.1 and summary["test_hr@10"] > 0.1, summary
    step = tmp / "ckpt" / f"step_{STEPS:08d}"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["model"]["categorical_ids"] == "zch" and manifest["model"]["zch_eviction_policy"] == "lfu"
    assert {s["type"] for s in manifest["sharding_plan"].values()} == {"row_wise"}
    saved = saved_tensors(str(step), [f"{MAP}._mch_sorted_raw_ids", f"{MAP}._mch_counts"])
    ids = saved[f"{MAP}._mch_sorted_raw_ids"]
    held = ids[ids != torch.iinfo(torch.int64).max]
    # every item was seen: each rank holds the items of its half of the id range, as many as its
    # share of rows takes but its last (kept for ids without one)
    items = torch.from_numpy(input_ids(np.arange(ITEMS)))
    first_half = int((items < -(-INPUT_HASH_SIZE // 2)).sum())
    rows = ITEMS // 2 - 1
    assert len(held) == min(rows, first_half) + min(rows, ITEMS - first_half)
    assert held.unique().numel() == len(held) and torch.isin(held, items).all()  # the items' raw ids
    assert (saved[f"{MAP}._mch_counts"][ids != torch.iinfo(torch.int64).max] > 0).all()


def test_resumes_exactly_where_it_stopped(trained, tmp_path):
    tmp, reference = trained
    killed = tmp_path / "killed"  # the checkpoints of the run stopped after step 30
    shutil.copytree(tmp / "ckpt" / f"step_{RESUMED_AT:08d}", killed / f"step_{RESUMED_AT:08d}")
    result, resumed = train(tmp_path, "again", *ZCH, "--steps", str(STEPS), "--checkpoint_dir", str(killed))
    assert_ok(result)
    assert resumed["resumed_from_step"] == RESUMED_AT
    for name in ("final_train_loss", "val_hr@10", "val_ndcg@10", "val_mrr", "test_hr@10", "test_mrr"):
        assert resumed[name] == reference[name], name  # bit for bit: the id map came back


def test_one_rank_merges_the_two_ranks_maps_and_evaluates_alike(trained, tmp_path):
    """The 2 ranks' checkpoint on 1 rank (the id maps merged, TorchRec's post-load sorting redone),
    its 2 batches of 128 users those of the 2 ranks' 1 of 64 each: the same figures, but for the
    few items without a row, which one default row per rank held there and the last rank's here."""
    tmp, two = trained
    evaluate = ["--evaluate_checkpoint", "latest", "--checkpoint_dir", str(tmp / "ckpt"), "--batch_size", "128"]
    result, one = train(tmp_path, "one", *ZCH, *evaluate, nproc=1)
    assert_ok(result)
    assert one["world_size"] == 1 and one["evaluated_step"] == STEPS
    for metric in ("val_hr@10", "val_mrr", "test_hr@10", "test_mrr"):
        assert one[metric] == pytest.approx(two[metric], abs=0.005), metric


def test_a_checkpoint_of_the_other_kind_of_ids_is_refused(trained, tmp_path):
    tmp, _ = trained
    evaluate = ["--evaluate_checkpoint", "latest", "--checkpoint_dir", str(tmp / "ckpt")]
    result, summary = train(tmp_path, "as_is", *evaluate, nproc=1)
    assert result.returncode != 0 and summary is None
    assert "was written for another model (categorical_ids:" in result.stderr


def test_ranking_learns_the_actions_of_raw_item_ids(tmp_path):
    """The ranking objective on raw ids: its ceiling, the synthetic actions' law, is of the items
    behind the ids (found back from them), and the model comes close to it."""
    result, summary = train(tmp_path, "out", "--categorical_ids", "zch", "--objective", "ranking", "--steps", "60")
    assert_ok(result)
    assert summary["auroc_ceiling"] > 0.85, summary  # of the items' own laws (of the raw ids': 0.5)
    assert summary["val_auroc"] > summary["auroc_ceiling"] - 0.05, summary


@pytest.mark.parametrize("kind", ["uint64", "text"])
def test_a_parquet_file_of_raw_item_ids_trains(tmp_path, kind):
    """Users walking items i, i+1, ... of 300, each item's id a 64-bit number far outside the
    table, or a text (a big catalogue's ids): learnt far above chance."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 30, (500,), generator=generator).tolist()
    starts = torch.randint(0, 300, (500,), generator=generator).tolist()
    items = [[(start + i) % 300 for i in range(length)] for start, length in zip(starts, lengths)]
    if kind == "text":
        ids = pa.array([[f"sku-{i:06d}" for i in row] for row in items], pa.list_(pa.string()))
    else:
        ids = pa.array([[(1 << 63) + (i << 40) + 17 for i in row] for row in items], pa.list_(pa.uint64()))
    table = pa.table(
        {
            "item_id": ids,
            "event_type": [[i % 4 for i in row] for row in items],
            "timestamp": [list(range(1_700_000_000, 1_700_000_000 + 60 * len(row), 60)) for row in items],
        }
    )
    pq.write_table(table, tmp_path / "users.parquet")
    data = ["--data", "parquet", "--data_path", str(tmp_path / "users.parquet"), "--epochs", "20"]
    result, summary = train(tmp_path, "out", *data, "--categorical_ids", "zch", "--num_items", "400")
    assert_ok(result)
    assert summary["val_hr@10"] > 0.3, summary  # the next item is the last one's successor; chance 10 / 300


def test_a_refused_option_stops_the_job_in_one_line(tmp_path):
    result, summary = train(tmp_path, "out", *ZCH, "--eval_negatives", "10", "--steps", "1", nproc=1)
    assert result.returncode != 0 and summary is None
    refusal = "--eval_negatives 10 draws random item ids, which are no items with --categorical_ids zch"
    assert [line for line in result.stderr.splitlines() if refusal in line], result.stderr[-3000:]
