"""--zch_columns in one process: which sparse features it makes managed-collision tables (from the
options alone), what it refuses in one line naming the option, the unsharded model's two
collections joined in feature order, where a table's state lives, and the plan preview's count of
the managed tables' id maps only."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import hashed_ids, text_fingerprints
from apps.core.zch.config import INPUT_HASH_SIZE
from apps.dlrm.config import train_config
from apps.dlrm.data.parquet.files import CheckedFiles
from apps.dlrm.data.parquet.read import RowDecoder
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
        ({"sparse_columns": ["u", "v"], "zch_columns": ["w"]},  # no pattern: the options alone refuse it
         "--zch_columns w names no column of --sparse_columns u,v: name some of them"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["u", "v"]},
         "--zch_columns u,v names every sparse column: give --categorical_ids zch instead"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["u"], "categorical_ids": "zch"},
         "--zch_columns u picks the managed-collision columns, but --categorical_ids zch manages every one"),
        ({"sparse_columns": ["u", "v"], "zch_columns": ["v"], "num_embeddings_per_feature": [100, 1]},
         "--num_embeddings 1 (table 1) is too small for --categorical_ids zch"),
    ],
)  # fmt: skip
def test_what_it_cannot_train_with_is_refused_in_one_line(options, message):
    with pytest.raises(ConfigError) as refused:
        train_config(**PARQUET, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def criteo_parquet(folder) -> str:
    """A Merlin/NVTabular Criteo layout's one file under ``folder``: label, I1..I2, C1..C12, the
    columns written out of natural order (C10 after C1, as a plain sort puts it)."""
    columns = {"label": [0, 1], "I1": [1.0, 2.0], "I2": [3.0, 4.0]}
    columns |= {f"C{k}": [k, k + 1] for k in sorted(range(1, 13), key=str)}
    folder.mkdir()
    pq.write_table(pa.table(columns), folder / "day_0.parquet")
    return str(folder)


CRITEO_PARQUET = {"data": "parquet", "dense_columns": ["I*"], "num_dense_features": 2, "num_sparse_features": 12}


@pytest.mark.parametrize(
    "sparse, zch, managed",
    [
        (["C*"], ["C3", "C10"], [2, 9]),  # natural order: C10 is the tenth, not the third
        (["C*"], ["C1?"], [9, 10, 11]),  # a pattern of --zch_columns, matched against the files' columns
        (["C1", "C1?", "C[2-9]"], ["C5"], [7]),  # several patterns: where C5 falls, the files say
    ],
)
def test_a_column_a_pattern_matches_is_placed_by_the_first_files_columns(tmp_path, sparse, zch, managed):
    data_path = criteo_parquet(tmp_path / "clicks")
    cfg = train_config(**CRITEO_PARQUET, data_path=data_path, sparse_columns=sparse, zch_columns=zch)
    assert cfg.zch_features == managed
    assert cfg.model_signature()["zch_features"] == managed  # a checkpoint records the positions
    (tmp_path / "clicks" / "day_0.parquet").unlink()
    assert cfg.zch_features == managed  # the schema was read once: the many calls read no file


@pytest.mark.parametrize(
    "zch, message",
    [
        (["C13"], "--zch_columns C13 names none of the sparse columns that --sparse_columns C* matches in "),
        (["I1"], "--zch_columns I1 names none of the sparse columns that --sparse_columns C* matches in "),
    ],
)
def test_a_name_no_sparse_column_of_the_files_has_is_refused_naming_them(tmp_path, zch, message):
    options = {**CRITEO_PARQUET, "data_path": criteo_parquet(tmp_path / "clicks"), "sparse_columns": ["C*"]}
    with pytest.raises(ConfigError) as refused:
        train_config(**options, zch_columns=zch)
    assert message in str(refused.value) and "C1, C2, C3," in str(refused.value)
    assert "\n" not in str(refused.value)


def test_files_not_here_are_left_to_the_trainers_and_refused_where_the_positions_are_needed(tmp_path):
    """A configuration of a cluster's path is made (a submission checks it); what needs the
    positions (the model, the plan preview) refuses in one line naming the fix."""
    absent = str(tmp_path / "on_the_cluster")
    options = {**CRITEO_PARQUET, "data_path": absent, "sparse_columns": ["C*"], "zch_columns": ["C3"]}
    cfg = train_config(**options)
    with pytest.raises(ConfigError, match="^--checkpoint_every 7 is not a multiple of --zch_eviction_interval"):
        train_config(**options, checkpoint_dir=str(tmp_path), checkpoint_every=7, zch_eviction_interval=5)  # checked
    with pytest.raises(ConfigError) as refused:
        _ = cfg.zch_features
    assert "name the columns one by one in --sparse_columns, or run this where --data_path can be read" in str(
        refused.value
    )


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


def test_the_plan_preview_places_a_column_a_pattern_matches_by_the_files_or_says_how(tmp_path, capsys):
    job = ["-j", "1x2", "-h", "aws_p4d.24xlarge", "--data", "parquet", "--sparse_columns", "C*"]
    job += ["--num_sparse_features", "12", "--zch_columns", "C10", "--sharding_type", "table_wise"]
    with pytest.raises(SystemExit) as exit:
        plan_main([*job, "--data_path", criteo_parquet(tmp_path / "clicks")])
    assert exit.value.code == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("t_cat_")]
    assert {row[0] for row in rows if "row_wise" in row} == {"t_cat_9"}
    with pytest.raises(SystemExit) as exit:
        plan_main([*job, "--data_path", str(tmp_path / "on_the_cluster")])
    refusal = capsys.readouterr().err.strip()
    assert exit.value.code != 0 and len(refusal.splitlines()) == 1
    assert "name the columns one by one in --sparse_columns, or run this where --data_path can be read" in refusal


def test_beside_as_is_rows_the_managed_columns_raw_ids_are_hashed_into_torchrecs_range(tmp_path):
    """Categorify'd columns stay rows (as_is) while a managed column takes raw ids, text too."""
    pq.write_table(
        pa.table({"label": [0, 1, 1], "x": [0.5, 1.0, 2.0], "shop": [3, 0, 9], "user": ["ann", "bob", "ann"]}),
        tmp_path / "day_0.parquet",
    )
    options = {"sparse_columns": ["shop", "user"], "dense_columns": ["x"], "categorical_ids": "as_is"}
    cfg = train_config(data="parquet", data_path=str(tmp_path), **options, zch_columns=["user"], num_embeddings=10)
    checked = CheckedFiles.open(cfg.model, cfg.data)  # the text column is taken: its ids are raw, not rows
    decoder = RowDecoder(checked.spec, cfg.model.table_sizes, "as_is", np.dtype(np.int64), False, cfg.zch_features)
    rows = decoder.decode(pq.read_table(tmp_path / "day_0.parquet"), lambda row: ("day_0", 0))
    assert rows.ids[0].tolist() == [3, 0, 9]
    users = hashed_ids(text_fingerprints(pa.array(["ann", "bob", "ann"])), INPUT_HASH_SIZE)
    assert rows.ids[1].tolist() == users.astype(np.int64).tolist() and max(users) >= 10  # not folded into rows
