"""Multi-hot features (several ids per sample per feature, pooled by the embedding bags) and the
DLRMv2 preset: synthetic multi-hot batches and their ceiling, MLPerf's Criteo derivation checked
against TorchRec's DLRMv2 example, sharded = unsharded training, and the preset training and
previewing its plan."""

import hashlib
import json
import re
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC

from apps.core.common.errors import ConfigError
from apps.core.data import RankShare
from apps.core.options import to_argv
from apps.dlrm.config import parse_train_config, train_config
from apps.dlrm.data.criteo import multi_hot
from apps.dlrm.data.criteo.loader import CriteoClickLogs
from apps.dlrm.data.criteo.multi_hot import expand, multi_hot_tables
from apps.dlrm.data.criteo.tables import MLPERF_MULTI_HOT_SIZES, TABLE_SIZE_PRESETS
from benchmarks.equivalence import STEPS, TOLERANCE, compare
from tests.conftest import TINY, assert_ok, run, torchrun
from tests.unit.test_criteo_data import TABLES, dataset, rows_of, write_folder
from tests.unit.test_synthetic import synthetic

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

ROWS = [1000, 50, 100_000, 7]
SIZES = [1, 3, 5, 2]
CFG = train_config(num_sparse_features=4, num_embeddings_per_feature=ROWS, multi_hot_sizes=SIZES, batch_size=128)


# --- synthetic data --------------------------------------------------------------------------


def per_sample(batch, key: str, size: int) -> np.ndarray:
    """The ids of feature ``key`` as [batch, size]."""
    return batch.sparse_features[key].values().numpy().reshape(-1, size)


@pytest.mark.unit
def test_synthetic_multi_hot_batches_have_the_sizes_ranges_and_determinism():
    data = synthetic(CFG)
    batch = data.block("train", 3)
    kjt = batch.sparse_features
    for t, (rows, size) in enumerate(zip(ROWS, SIZES)):
        assert kjt[f"cat_{t}"].lengths().tolist() == [size] * 128
        ids = per_sample(batch, f"cat_{t}", size)
        assert ids.min() >= 0 and ids.max() < rows
    assert not np.all(per_sample(batch, "cat_2", 5) == per_sample(batch, "cat_2", 5)[:, :1])  # not 5 copies
    again = synthetic(CFG).block("train", 3)
    assert torch.equal(kjt.values(), again.sparse_features.values()) and torch.equal(batch.labels, again.labels)
    assert not torch.equal(kjt.values(), data.block("train", 4).sparse_features.values())


@pytest.mark.unit
def test_one_id_per_feature_gives_the_one_hot_batches():
    one_hot = train_config(num_sparse_features=4, num_embeddings_per_feature=ROWS, batch_size=128)
    ones = one_hot.replace(multi_hot_sizes=[1, 1, 1, 1], pooling="mean")
    a, b = synthetic(one_hot).block("val", 2), synthetic(ones).block("val", 2)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)


@pytest.mark.unit
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_teacher_pools_like_the_model_and_sets_a_ceiling(pooling):
    cfg = train_config(multi_hot_sizes=MLPERF_MULTI_HOT_SIZES, pooling=pooling)
    data = synthetic(cfg)
    auroc = BinaryAUROC()
    for batch in data.eval_batches("val", 10):
        auroc.update(data.teacher_logits(batch), batch.labels.long())
    assert 0.72 < auroc.compute().item() < 0.9
    # the teacher's logit of a sample is its pooled per-id weights: mean != sum with several ids
    other = synthetic(
        train_config(multi_hot_sizes=MLPERF_MULTI_HOT_SIZES, pooling="sum" if pooling == "mean" else "mean")
    )
    assert not torch.allclose(data.teacher_logits(batch), other.teacher_logits(batch))


# --- Criteo: MLPerf's derivation ------------------------------------------------------------

#: Produced by TorchRec's DLRMv2 example itself (facebookresearch/dlrm torchrec_dlrm/multi_hot.py
#: at 090956e, ``Multihot(MLPERF_MULTI_HOT_SIZES, SAMPLE_ROWS, 4, False, "uniform")``, the same
#: file as mlcommons/training recommendation_v2/torchrec_dlrm/multi_hot.py): the SHA-256 of its
#: lookup tables (int32, little-endian, feature after feature), and of the KJT values that its
#: ``convert_to_multi_hot`` makes of SAMPLE_IDS. That module is not shipped in the torchrec
#: package, so it cannot run here.
SAMPLE_ROWS = [min(rows, 50_000) for rows in TABLE_SIZE_PRESETS["mlperf"]]
SAMPLE_IDS = [[0, r - 1, r // 2, (7919 * (f + 1)) % r] for f, r in enumerate(SAMPLE_ROWS)]
REFERENCE_TABLES_SHA256 = "dfc29fbfe92c1f2f0af1b6ec420448a9437f33ed15d8aa9c47fb7464e90f59bd"
REFERENCE_VALUES_SHA256 = "144e5061354bd2b530360f8b78b2682898055b66451250e57da2992acdf31f4e"
REFERENCE_CAT_0 = [0, 2732, 43567, 49999, 13903, 42122, 25000, 32526, 32216, 7919, 41436, 2089]


def test_criteo_multi_hot_ids_are_those_of_torchrec_dlrmv2_example():
    tables = multi_hot_tables(MLPERF_MULTI_HOT_SIZES, SAMPLE_ROWS)
    digest = hashlib.sha256()
    for table in tables:
        digest.update(table.astype("<i4").tobytes())
    assert digest.hexdigest() == REFERENCE_TABLES_SHA256
    values = np.empty(4 * sum(MLPERF_MULTI_HOT_SIZES), np.int32)
    expand(np.array(SAMPLE_IDS, np.int32), tables, values)
    assert hashlib.sha256(values.astype("<i4").tobytes()).hexdigest() == REFERENCE_VALUES_SHA256
    assert values[:12].tolist() == REFERENCE_CAT_0


@pytest.mark.unit
def test_criteo_loader_makes_multi_hot_batches(tmp_path):
    folder = write_folder(tmp_path / "npy", [300, 300])
    sizes = [1 + f % 4 for f in range(26)]
    batch = next(iter(dataset(folder, multi_hot_sizes=sizes).train_batches()))
    tables = multi_hot_tables(sizes, [TABLES] * 26)
    for f in (0, 3, 25):
        one_hot = [(r + f) % TABLES for r in rows_of(batch)]  # write_folder's ids
        ids = per_sample(batch, f"cat_{f}", sizes[f])
        assert ids[:, 0].tolist() == one_hot
        assert np.array_equal(ids, tables[f][one_hot])


@pytest.mark.unit
def test_multi_hot_tables_are_drawn_without_a_wide_temporary():
    """The tables are int32; a draw of int64 ids for a whole table beside them took 3x their
    size at MLPerf's sizes (a 15 GiB temporary), enough to kill a host that holds the tables."""
    tracemalloc.start()
    try:
        tables = multi_hot_tables([1, 100], [10, 200_000])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    held = sum(table.nbytes for table in tables)
    assert held == (10 + 200_000 * 100) * 4 and peak < 1.25 * held, (peak, held)


@pytest.mark.unit
def test_multi_hot_tables_that_host_memory_cannot_hold_are_refused_before_they_are_drawn(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "npy", [300, 300])
    sizes = [100] * 26  # 26 tables of 1000 x 100 int32 ids: 9.9 MiB in each training process
    monkeypatch.setattr(multi_hot, "available_host_memory", lambda: 30 << 20)
    assert len(dataset(folder, multi_hot_sizes=sizes).keys) == 26  # 3 processes fit
    cfg = train_config(data="criteo", data_path=folder, num_embeddings=TABLES, multi_hot_sizes=sizes, batch_size=50)
    with pytest.raises(ConfigError, match=re.escape("take 9.9 MiB in each of this host's 4 training processes")) as e:
        CriteoClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training, 0, 4), folder, False, local_world_size=4)
    assert "(39.7 MiB in all), but 30.0 MiB is available" in str(e.value)


@pytest.mark.unit
def test_a_containers_memory_limit_is_what_is_available(tmp_path, monkeypatch):
    """Under a limit (Kubernetes, AWS Batch) the kernel kills at the limit, whatever the host has
    free; its reclaimable page cache (the mapped days') counts as free."""
    files = [tmp_path / name for name in ("max", "current", "stat")]
    for path, text in zip(files, ["3000000", "2000000", "anon 1\ninactive_file 500000\n"]):
        path.write_text(text)
    monkeypatch.setattr(multi_hot, "_CGROUPS", ((*map(str, files), "inactive_file"),))
    assert multi_hot.available_host_memory() == 1_500_000
    files[0].write_text("max\n")  # no limit: the host's MemAvailable
    assert multi_hot.available_host_memory() > 1_500_000


# --- sharded = unsharded ---------------------------------------------------------------------


@pytest.mark.parametrize("sharding_type, pooling", [("table_wise", "sum"), ("row_wise", "mean")])
def test_multi_hot_sharded_training_matches_unsharded_reference(sharding_type, pooling, tmp_path):
    # Not to the bit for row_wise: a bag whose ids fall in two shards is pooled as two partial
    # sums added together, a different order of the same float32 sum.
    result = compare(sharding_type, 2, str(tmp_path), multi_hot_sizes=MLPERF_MULTI_HOT_SIZES, pooling=pooling)
    assert set(result.plan) == {sharding_type} and len(result.sharded) == STEPS
    assert result.sharded == pytest.approx(result.reference, abs=TOLERANCE), (result.sharded, result.reference)
    assert result.equal


# --- the DLRMv2 preset -----------------------------------------------------------------------


@pytest.mark.unit
def test_preset_fills_defaults_and_explicit_options_win():
    cfg = train_config(preset="dlrmv2")
    model, training = cfg.model, cfg.training
    assert (model.interaction_type, model.dcn_num_layers, model.dcn_low_rank_dim) == ("dcn", 3, 512)
    assert model.dense_arch_layer_sizes == [512, 256, 128]
    assert model.over_arch_layer_sizes == [1024, 1024, 512, 256, 1]
    assert model.table_sizes == TABLE_SIZE_PRESETS["mlperf"] and model.multi_hot_sizes == MLPERF_MULTI_HOT_SIZES
    assert (training.embedding_optimizer, training.dense_optimizer) == ("adagrad", "adagrad")
    assert (training.learning_rate, training.dense_lr) == (0.005, 0.005)
    assert (training.batch_size, training.lr_warmup_steps, training.lr_decay_steps) == (8192, 0, 0)
    assert parse_train_config(to_argv(cfg)) == cfg  # what the component hands the app
    small = train_config(preset="dlrmv2", num_embeddings=2000, batch_size=256, learning_rate=0.01)
    assert small.model.table_sizes == [2000] * 26
    assert (small.training.batch_size, small.training.dense_lr) == (256, 0.01)
    assert small.model.interaction_type == "dcn"


@pytest.mark.unit
def test_an_option_given_at_its_default_value_wins_over_the_preset():
    """The app's parser knows what was given: --batch_size 512 (the default) is not 8192."""
    given = parse_train_config(["--preset", "dlrmv2", "--batch_size", "512", "--num_embeddings", "20000"])
    assert given.training.batch_size == 512
    assert given.model.table_sizes == [20000] * 26  # a table size given keeps the preset's out
    assert given.model.embedding_dim == 128  # the options not given are the preset's
    assert parse_train_config(to_argv(given)) == given  # the component hands the app the same run
    assert parse_train_config(["--preset", "dlrmv2"]).training.batch_size == 8192


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(preset="dlrmv2", num_sparse_features=8), "--preset dlrmv2 is a model of Criteo's 13 dense and 26 sparse"),
        (dict(multi_hot_sizes=[2, 3]), "--multi_hot_sizes has 2 entries (2,3) but there are 26 sparse features"),
        (dict(multi_hot_sizes=[0] * 26), "--multi_hot_sizes entry 0 is 0"),
        (dict(pooling="max"), "--pooling 'max' is not supported: use one of sum, mean"),
    ],
)
def test_bad_multi_hot_options_name_the_value_and_the_fix(kwargs, fragment):
    with pytest.raises(ConfigError) as error:
        train_config(**kwargs)
    assert fragment in str(error.value)


def test_dlrmv2_preset_trains_scaled_down_under_torchrun(tmp_path):
    result = torchrun(
        [
            "-m",
            "apps.dlrm.train",
            "--preset",
            "dlrmv2",
            *TINY,
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert_ok(result)
    summary = json.loads((tmp_path / "summary.json").read_text())
    config = summary["config"]
    assert config["multi_hot_sizes"] == MLPERF_MULTI_HOT_SIZES and config["interaction_type"] == "dcn"
    assert config["num_embeddings_per_feature"] == [] and config["batch_size"] == 256
    assert summary["final_train_loss"] < 0.69  # below the loss of predicting 0.5
    assert summary["val_auroc"] > 0.55


def test_plan_previews_the_dlrmv2_preset_on_a_p5():
    result = run([sys.executable, "-m", "apps.dlrm.plan", "--preset", "dlrmv2", "-j", "1x8", "-h", "aws_p5.48xlarge"])
    assert_ok(result)
    assert "1 node x 8 GPUs (8 ranks) of aws_p5.48xlarge, batch 8192 per rank" in result.stdout
    assert "t_cat_20  40,000,000  128" in result.stdout
    assert "\nfits: " in result.stdout
