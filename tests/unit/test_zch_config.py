"""--categorical_ids zch in one process: its options refused in one line naming them, the
unsharded model of managed-collision tables (TorchRec's MCH modules giving frequent ids rows),
the CPU reset of a row that changes hands, and what the plan preview counts of the id maps."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.errors import ConfigError
from apps.core.zch.config import check_world_size
from apps.core.zch.modules import _reset_host_rows, bytes_per_rank, history_bytes, ids_with_rows, state_bytes
from apps.dlrm.config import train_config
from apps.dlrm.model import build_model
from apps.dlrm.plan import main as plan_main
from apps.hstu.config import train_config as hstu_train_config
from components import dlrm, hstu
from components.signature import InvalidComponentArgument

TIER = "unit"

ZCH = {"categorical_ids": "zch"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_embeddings": 1}, "--num_embeddings 1 (table 0) is too small for --categorical_ids zch"),
        ({"zch_eviction_policy": "fifo"}, "--zch_eviction_policy 'fifo' is not supported: use one of lfu, lru, distance_lfu"),
        ({"zch_eviction_interval": 0}, "--zch_eviction_interval 0 must be positive"),
        ({"sharding_type": "table_wise"}, "--sharding_type table_wise: TorchRec shards managed-collision tables (--categorical_ids zch) row_wise only"),
        ({"checkpoint_dir": "/tmp/c", "checkpoint_every": 10, "zch_eviction_interval": 3},
         "--checkpoint_every 10 is not a multiple of --zch_eviction_interval 3"),
        ({"data": "criteo", "data_path": "/tmp/criteo"}, "--categorical_ids zch maps raw ids, but --data criteo's folders"),
    ],
)  # fmt: skip
def test_what_zch_cannot_train_with_is_refused_in_one_line(options, message):
    with pytest.raises(ConfigError) as refused:
        train_config(**ZCH, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_zch_options_are_accepted_where_they_fit():
    cfg = train_config(**ZCH, zch_eviction_policy="distance_lfu", zch_eviction_interval=5, checkpoint_every=10)
    assert cfg.model_signature()["categorical_ids"] == "zch"
    assert "categorical_ids" not in train_config().model_signature()  # hashed models' checkpoints as before


def test_a_world_that_leaves_a_rank_too_few_rows_is_refused():
    check_world_size({"t": 4}, 2)  # 2 rows a rank: one for ids, one kept for those without
    with pytest.raises(ConfigError, match=r"^--num_items 5 \(table t\) on 3 ranks leaves a rank 1 rows"):
        check_world_size({"t": 5}, 3, "--num_items")  # TorchRec's shares: 2, 2, 1
    with pytest.raises(ConfigError, match="17 ranks: TorchRec's planner splits managed-collision tables"):
        check_world_size({"t": 1000}, 17)


@pytest.mark.parametrize(
    "component, managed, options, message",
    [
        (dlrm.train, ZCH, {"j": "1x3", "num_embeddings": 5}, "--num_embeddings 5 (table 0) on 3 ranks leaves a rank 1 rows"),
        (dlrm.train, ZCH, {"j": "1:2x2", "num_embeddings_per_feature": [8] * 25 + [6]},
         "--num_embeddings_per_feature 6 (table 25) on 4 ranks leaves a rank 0 rows"),  # elastic: 2 or 4 ranks
        (dlrm.train, {"zch_columns": ["cat_2"]}, {"j": "1x3", "num_embeddings_per_feature": [5] * 26},
         "--num_embeddings_per_feature 5 (table 2) on 3 ranks leaves a rank 1 rows"),  # cat_2's table only
        (hstu.train, ZCH, {"j": "3", "num_items": 5}, "--num_items 5 (table 0) on 3 ranks leaves a rank 1 rows"),
    ],
)  # fmt: skip
def test_a_job_size_that_cannot_split_the_managed_tables_is_refused_at_submission(component, managed, options, message):
    with pytest.raises(InvalidComponentArgument) as refused:
        component(**managed, **options)
    assert str(refused.value).startswith(message)
    component(**options)  # hashed tables split over any ranks
    component(**managed, **{**options, "j": "1x1"})


@pytest.mark.parametrize(
    "train_config, how",
    [(train_config, "--categorical_ids zch or --zch_columns"), (hstu_train_config, "--categorical_ids zch")],
)
def test_zch_options_without_zch_tables_are_refused(train_config, how):
    with pytest.raises(ConfigError) as refused:
        train_config(zch_eviction_policy="lru")
    assert str(refused.value) == (
        "--zch_eviction_policy lru applies to managed-collision tables only, and this job has none: "
        f"add {how}, or drop --zch_eviction_policy"
    )
    train_config(**ZCH, zch_eviction_policy="lru", zch_eviction_interval=2)


def test_zch_options_apply_to_the_managed_columns_of_a_mixed_job():
    train_config(zch_columns=["cat_1"], zch_eviction_policy="lru", zch_eviction_interval=2)


def test_the_plan_preview_counts_the_id_maps_in_each_ranks_memory(capsys):
    with pytest.raises(SystemExit) as exit:
        plan_main(["-j", "1x2", "-h", "aws_p4d.24xlarge", "--categorical_ids", "zch", "--num_embeddings", "1000000"])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    # 26 tables' sorted ids, rows and LFU counts (int64), half on each rank, and a batch of ids to count
    id_maps = 26 * 1_000_000 * 3 * 8 // 2 + 26 * int(16384 * 1.25) * 8
    assert f"managed-collision id maps (zch tables): {id_maps / 2**30:.2f} GiB per rank" in shown
    assert "row_wise" in shown and "table_wise" not in shown


def batch(ids: list[int], features: int = 2) -> Batch:
    rows = len(ids) // features
    kjt = KeyedJaggedTensor(
        keys=[f"cat_{k}" for k in range(features)],
        values=torch.tensor(ids, dtype=torch.int64),
        lengths=torch.ones(len(ids), dtype=torch.int32),
    )
    return Batch(dense_features=torch.zeros(rows, 13), sparse_features=kjt, labels=torch.zeros(rows))


def test_the_unsharded_model_gives_the_most_frequent_ids_rows_and_the_rest_its_last_row():
    cfg = train_config(**ZCH, num_sparse_features=2, num_embeddings=4, embedding_optimizer="sgd")
    model = build_model(cfg.model, torch.device("cpu"), torch.device("cpu"), zch=cfg.zch)
    frequent, rare = [2**50 + 7, 2**40 + 3, 12345], [2**45 + k for k in range(5)]
    for step in range(4):  # each step the frequent ids twice, a new rare one once
        ids = frequent + frequent + [rare[step]]
        loss, _ = model(batch(ids + ids))
        loss.backward()
    assert ids_with_rows(model) == {"t_cat_0": 3, "t_cat_1": 3}  # 4 rows: 3 for ids, the last for the rest
    mapper = model.model.sparse_arch.embedding_bag_collection._managed_collision_collection.eval()
    ids = frequent + [rare[0], rare[4]]  # a rare id seen once, one never seen
    rows = mapper(batch(ids + ids).sparse_features).values().tolist()
    assert sorted(rows[:3]) == [0, 1, 2] and rows[3:5] == [3, 3]  # the rare ones: the last row


def test_the_cpu_reset_zeroes_a_rows_weights_and_row_wise_adagrad_state():
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU), (6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    )
    with torch.no_grad():
        tbe.weights_host.fill_(1.0)
        tbe.momentum1_host.fill_(2.0)
    _reset_host_rows(tbe, torch.tensor([1, 5]), torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([0]))
    table_1 = tbe.weights_host[40:].view(6, 4)
    assert table_1[[1, 5]].eq(0).all() and table_1[[0, 2, 3, 4]].eq(1).all() and tbe.weights_host[:40].eq(1).all()
    assert tbe.momentum1_host[10:].tolist() == [2, 0, 2, 2, 2, 0] and tbe.momentum1_host[:10].eq(2).all()


def test_the_id_maps_bytes_are_their_int64_buffers_and_the_history_the_policys():
    cfg = train_config(**ZCH, num_sparse_features=2, num_embeddings=100)
    model = build_model(cfg.model, torch.device("meta"), zch=cfg.zch)
    assert state_bytes(model) == 2 * 100 * 3 * 8  # sorted ids, their rows, LFU's counts
    history = int(1000 * 1 * 1.25) * 8  # 1,000 ids a step, the default interval of 1
    assert bytes_per_rank(model, 2, {"t_cat_0": 1000, "t_cat_1": 1000}) == 2 * 100 * 3 * 8 // 2 + 2 * history
    lru = train_config(**ZCH, zch_eviction_policy="lru", zch_eviction_interval=10)
    module = next(
        m for m in build_model(lru.model, torch.device("meta"), zch=lru.zch).modules() if hasattr(m, "_zch_size")
    )
    assert history_bytes(module, 1000) == int(1000 * 10 * 1.25) * 2 * 8  # and each id's step


@pytest.mark.parametrize("policy, state", [("lfu", {"counts"}), ("lru", {"last_access_iter"}),
                                           ("distance_lfu", {"counts", "last_access_iter"})])  # fmt: skip
def test_every_eviction_policy_trains_and_keeps_its_state_in_the_model(policy, state):
    cfg = train_config(**ZCH, num_sparse_features=2, num_embeddings=8, zch_eviction_policy=policy)
    model = build_model(cfg.model, torch.device("cpu"), torch.device("cpu"), zch=cfg.zch)
    for step in range(3):
        ids = [2**49 + step * 10 + k for k in range(4)]
        loss, _ = model(batch(ids + ids))
        loss.backward()
    kept = {key.rsplit("._mch_", 1)[1] for key in model.state_dict() if "t_cat_0._mch_" in key}
    assert kept == {"sorted_raw_ids", "remapped_ids_mapping", *state}
    assert ids_with_rows(model)["t_cat_0"] == 7  # 12 ids seen, 7 rows to give (the 8th: the rest's)
