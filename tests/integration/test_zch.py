"""--categorical_ids zch end to end: a DLRM of TorchRec's managed-collision tables trained on raw ids
(50-bit integers and text) by 2 CPU ranks under torchrun, its id maps checkpointed with the tables,
resumed exactly, merged into 1 rank (evaluation, export), a 1-rank checkpoint split over 2 ranks
(every id's row and optimizer state kept, evaluated alike, trained on), refused in a model of
hashed ids, and its package mapping ids as the merged model does."""

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.checkpoint.id_maps import NO_ID
from apps.core.zch.config import INPUT_HASH_SIZE
from apps.dlrm.serving.api import load_model
from apps.dlrm.serving.config import ExportConfig
from apps.dlrm.serving.export import export
from testing.click_parquet import scores_auroc
from testing.raw_ids import write_raw_id_parquet
from tests.conftest import REPO, assert_ok, run, torchrun, torchrun_job
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


#: Distinct raw ids per column of the data a 1-rank checkpoint is split from: few enough that every
#: id seen has a row on either of 2 ranks (each of 255 rows for ids, a share of about 150).
ROOMY = 300


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A 1-rank checkpoint (step 10) loaded on 2 ranks in one torchrun (tests/checkpoint_worker.py):
    dumped as its ranks hold it once resumed, evaluated, then trained on to step 30. Returns the
    checkpoint's tensors, the 1-rank run's summary, each rank's dump and the 2-rank summaries."""
    tmp = tmp_path_factory.mktemp("zch-split")
    data, ckpt = str(tmp / "data"), str(tmp / "ckpt")
    write_raw_id_parquet(data, rows=ROWS, files=FILES, distinct=ROOMY)
    everything = ["--test_batches", "0"]  # the whole test split on any world size
    one, reference = train(tmp, "one", data, *ZCH, *everything, "--steps", "10", "--checkpoint_dir", ckpt, nproc=1)
    assert_ok(one)
    saved = saved_tensors(f"{ckpt}/step_00000010")
    job = ["--data", "parquet", "--data_path", data, *MODEL, *ZCH, *everything]
    runs = [
        {"args": [*job, "--output_dir", ""], "resume": [ckpt], "dump": str(tmp / "dump")},
        {
            "args": [
                *job,
                "--checkpoint_dir",
                ckpt,
                "--evaluate_checkpoint",
                "10",
                "--output_dir",
                str(tmp / "evaluated"),
            ]
        },
        {"args": [*job, "--checkpoint_dir", ckpt, "--steps", "30", "--output_dir", str(tmp / "resumed")]},
    ]
    (tmp / "runs.json").write_text(json.dumps(runs))
    assert_ok(torchrun([f"{REPO}/tests/checkpoint_worker.py", str(tmp / "runs.json")], nproc=2))
    dumps = [torch.load(tmp / f"dump.0.rank{rank}.pt")["pieces"] for rank in range(2)]
    summaries = {name: json.loads((tmp / name / "summary.json").read_text()) for name in ("evaluated", "resumed")}
    return saved, reference, dumps, summaries


def table_state(table, source):
    """A managed-collision table's ids, rows, LFU counts, weight and row-wise Adagrad state, whole:
    from a checkpoint's tensors (a dict), or put together exactly (ids are int64) from every rank's
    dumped pieces (a list)."""
    weight = f"model.sparse_arch.embedding_bag_collection._embedding_module.embedding_bags.{table}.weight"
    names = {
        "ids": f"{MAPS}.{table}._mch_sorted_raw_ids",
        "rows": f"{MAPS}.{table}._mch_remapped_ids_mapping",
        "counts": f"{MAPS}.{table}._mch_counts",
        "weight": f"model.{weight}",
        "momentum1": f"optimizer.state.fused.{weight}.{table}.momentum1",
    }
    if isinstance(source, dict):
        return {what: source[name] for what, name in names.items()}
    return {
        what: torch.cat([t for _, t in sorted(p for dump in source for p in dump[name])])
        for what, name in names.items()
    }


def test_a_split_keeps_every_ids_row_and_optimizer_state(split):
    saved, _, dumps, _ = split
    for table in ("t_cat_0", "t_cat_1", "t_cat_2"):
        before, after = table_state(table, saved), table_state(table, dumps)
        had, has = before["ids"] != NO_ID, after["ids"] != NO_ID
        assert 100 < had.sum() == has.sum() < ROOMY  # every id kept its row: there was room
        halves = after["ids"].view(2, -1)  # each rank's share: its block of the input range, sorted
        assert (halves[0][halves[0] != NO_ID] < 2**62).all() and (halves[1][halves[1] != NO_ID] >= 2**62).all()
        assert all(torch.equal(half, half.sort().values) for half in halves)
        order = torch.argsort(after["ids"][has])
        assert torch.equal(after["ids"][has][order], before["ids"][had])  # the same ids
        assert torch.equal(after["counts"][has][order], before["counts"][had])  # with their counts
        rows_before, rows_after = before["rows"][had], after["rows"][has][order]
        for what in ("weight", "momentum1"):  # bit for bit, each at its new row
            assert torch.equal(after[what][rows_after], before[what][rows_before]), (table, what)
            # every rank's default row (its share's last) is the 1 rank's: ids without a row look up what they did
            assert torch.equal(after[what][[255, 511]], before[what][[511, 511]]), (table, what)


def test_a_split_checkpoint_evaluates_as_the_rank_that_wrote_it_and_trains_on(split):
    _, reference, _, summaries = split
    evaluated, resumed = summaries["evaluated"], summaries["resumed"]
    assert evaluated["world_size"] == 2 and evaluated["evaluated_step"] == 10
    # the same rows of the same ids (and the same default row) score the whole test split as 1 rank did:
    # only the order of float additions differs
    assert abs(evaluated["test_auroc"] - reference["test_auroc"]) <= 1e-6
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 30
    assert resumed["final_train_loss"] < reference["final_train_loss"]
    assert resumed["test_auroc"] > reference["test_auroc"] + 0.02


def test_two_ranks_full_maps_split_over_three_keep_the_most_counted_ids_of_each_range(trained, tmp_path):
    """2 to 3 ranks: the middle rank's id range straddles both saved ones; the saved shares are
    full (510 ids), more than 3 shares of 171 or 170 rows hold less their default rows."""
    tmp, data, _ = trained
    runs = [{"args": ["--data", "parquet", "--data_path", data, *MODEL, *ZCH, "--output_dir", ""]}]
    runs[0] |= {"resume": [str(tmp / "ckpt")], "dump": str(tmp_path / "dump")}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    assert_ok(torchrun([f"{REPO}/tests/checkpoint_worker.py", str(tmp_path / "runs.json")], nproc=3))
    dumps = [torch.load(tmp_path / f"dump.0.rank{rank}.pt")["pieces"] for rank in range(3)]
    saved = saved_tensors(str(tmp / "ckpt" / "step_00000040"))
    shares = [(0, 171), (171, 342), (342, 512)]
    edges = [i * -(-INPUT_HASH_SIZE // 3) for i in range(3)] + [INPUT_HASH_SIZE]
    for table in ("t_cat_0", "t_cat_1", "t_cat_2"):
        before, after = table_state(table, saved), table_state(table, dumps)
        had = before["ids"] != NO_ID
        assert (after["ids"] != NO_ID).sum() < had.sum() == 510  # some lost their rows
        for rank, (first, end) in enumerate(shares):
            ids = after["ids"][first:end]
            held = ids[ids != NO_ID]
            candidates = had & (before["ids"] >= edges[rank]) & (before["ids"] < edges[rank + 1])
            assert torch.equal(held, held.unique())  # sorted, each once
            assert len(held) == min(int(candidates.sum()), end - first - 1)  # all, or all its rows but the default
            kept = torch.isin(before["ids"], held)
            assert not (kept & ~candidates).any()  # of its own range only
            lost = candidates & ~kept
            if lost.any():  # LFU: none kept was counted less than one that lost its row
                assert before["counts"][lost].max() <= before["counts"][kept].min()
            position = torch.searchsorted(held, before["ids"][kept])
            for what in ("counts", "weight", "momentum1"):
                now = after[what][first:end]
                moved = now[position] if what == "counts" else after[what][after["rows"][first + position]]
                was = before[what][kept] if what == "counts" else before[what][before["rows"][kept]]
                assert torch.equal(moved, was), (table, rank, what)
            for what in ("weight", "momentum1"):  # the default row of the saved share whose range holds most of its own
                assert torch.equal(after[what][end - 1], before[what][(255, 511, 511)[rank]]), (table, rank, what)


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
