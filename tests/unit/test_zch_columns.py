"""--zch_columns in one process: which sparse features it makes managed-collision tables (from the
options alone), what it refuses in one line naming the option, the unsharded model's two
collections joined in feature order, where a table's state lives, and the plan preview's count of
the managed tables' id maps only."""

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

from apps.core.common.errors import ConfigError
from apps.dlrm.config import train_config
from apps.dlrm.model import EBC_PATH, MC_EBC_PATH, build_model
from apps.dlrm.plan import main as plan_main
from apps.dlrm.training.app import app_for
from tests.unit.test_zch_config import batch

TIER = "unit"

PARQUET = {"data": "parquet", "data_path": "/tmp/clicks"}


@pytest.mark.parametrize(
    "options, managed",
    [
        ({"sparse_columns": ["user_id", "shop", "item_id"], "zch_columns": ["item_id", "user_id"]}, [0, 2]),
        ({"sparse_columns": ["user_id", "item_id", "cat_*"], "num_sparse_features": 28, "zch_columns": ["*_id"]}, [0, 1]),
        # the one pattern's columns are the features left by the named ones, wherever it stands
        ({"sparse_columns": ["a", "cat_*", "b"], "num_sparse_features": 6, "zch_columns": ["cat_*", "b"]}, [1, 2, 3, 4, 5]),
    ],
)  # fmt: skip
def test_the_named_columns_features_are_managed(options, managed):
    cfg = train_config(**PARQUET, **options)
    assert cfg.zch_features == managed
    assert cfg.model_signature()["zch_features"] == managed  # a checkpoint records which


def test_synthetic_data_names_its_features():
    assert train_config(zch_columns=["cat_3", "cat_1*"], num_sparse_features=12).zch_features == [1, 3, 10, 11]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sparse_columns": ["user_id", "cat_*"], "num_sparse_features": 5, "zch_columns": ["cat_1"]},
         "--zch_columns cat_1 names no column of --sparse_columns user_id,cat_*: name columns given there"),
        ({"sparse_columns": ["u", "a_*", "b_*", "v"], "num_sparse_features": 9, "zch_columns": ["v"]},
         "--zch_columns v: where v falls among the sparse features depends on how many columns the patterns"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["u", "v"]},
         "--zch_columns u,v names every sparse column: give --categorical_ids zch instead"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["u"], "categorical_ids": "zch"},
         "--zch_columns u picks the managed-collision columns, but --categorical_ids zch manages every one"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["u"], "categorical_ids": "as_is"},
         "--zch_columns u with --categorical_ids as_is"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["v"], "num_embeddings_per_feature": [100, 1]},
         "--num_embeddings 1 (table 0) is too small for --categorical_ids zch"),
    ],
)  # fmt: skip
def test_what_it_cannot_train_with_is_refused_in_one_line(options, message):
    with pytest.raises(ConfigError) as refused:
        train_config(**PARQUET, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_criteo_folders_are_refused_as_with_every_table_managed():
    with pytest.raises(ConfigError, match="--zch_columns maps raw ids, but --data criteo's folders"):
        train_config(data="criteo", data_path="/tmp/criteo", zch_columns=["cat_0"])


def test_the_sharding_type_is_the_plain_tables():
    cfg = train_config(**PARQUET, sparse_columns=["u", "v", "w"], zch_columns=["v"], sharding_type="table_wise")
    tables = app_for(cfg).tables
    assert tables.paths == [EBC_PATH, MC_EBC_PATH] and tables.managed
    assert tables.module_of("t_cat_1").managed and not tables.module_of("t_cat_0").managed
    assert tables.weight_key("t_cat_1") == f"{MC_EBC_PATH}._embedding_module.embedding_bags.t_cat_1.weight"
    assert tables.weight_key("t_cat_2") == f"{EBC_PATH}.embedding_bags.t_cat_2.weight"
    state = f"state.fused.{MC_EBC_PATH}._embedding_module.embedding_bags.t_cat_1.weight.t_cat_1.momentum1"
    match = tables.match_state_key(state)
    assert match is not None and (match["table"], match["state"]) == ("t_cat_1", "t_cat_1.momentum1")


def test_the_two_collections_embeddings_reach_the_interaction_in_feature_order():
    cfg = train_config(zch_columns=["cat_1"], num_sparse_features=3, num_embeddings=8)
    model = build_model(cfg.model, torch.device("cpu"), torch.device("cpu"), zch=cfg.zch, managed=cfg.zch_features)
    arch = model.model.sparse_arch
    assert isinstance(arch.embedding_bag_collection, EmbeddingBagCollection)
    assert isinstance(arch.managed_collection, ManagedCollisionEmbeddingBagCollection)
    with torch.no_grad():  # every row of table t_cat_k holds k
        for name, weight in model.named_parameters():
            if "t_cat_" in name:
                weight.fill_(float(name.split("t_cat_")[1][0]))
    features: Batch = batch([3, 5, 2**50 + 1, 2**50 + 2, 6, 7], features=3)  # feature-major: cat_1 raw ids
    pooled = arch(features.sparse_features)
    assert pooled.shape == (2, 3, 16)
    assert pooled[:, :, 0].tolist() == [[0.0, 1.0, 2.0]] * 2


def test_the_plan_preview_counts_the_managed_tables_id_maps_only(capsys):
    half = ",".join(f"cat_{k}" for k in range(13))
    job = ["-j", "1x2", "-h", "aws_p4d.24xlarge", "--num_embeddings", "1000000", "--sharding_type", "table_wise"]
    with pytest.raises(SystemExit) as exit:
        plan_main([*job, "--zch_columns", half])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    # 13 tables' sorted ids, rows and LFU counts (int64), half on each rank, and a batch of ids to count
    id_maps = 13 * 1_000_000 * 3 * 8 // 2 + 13 * int(16384 * 1.25) * 8
    assert f"{id_maps / 2**30:.2f} GiB per rank" in shown
    rows = [line.split() for line in shown.splitlines() if line.startswith("t_cat_")]
    assert {row[0] for row in rows if "row_wise" in row} == {f"t_cat_{k}" for k in range(13)}
    assert {row[0] for row in rows if "table_wise" in row} == {f"t_cat_{k}" for k in range(13, 26)}
