"""The topology the training app plans with: its HBM per GPU rank is --hbm_gb, or the GPU's own.

TorchRec's planner plans for cuda ranks without a GPU, so these run on this CPU machine: the app's
``training_topology`` with a GPU's byte count given, against the plan preview of the same job.
"""

import pytest
import torch

from apps.core.common.distributed import DistEnv
from apps.core.common.errors import ConfigError
from apps.core.launch.target import GiB, PlanTarget
from apps.core.training.device_support import check_device_support
from apps.core.training.sharding import make_planner, model_to_shard, plan_tables, training_topology
from apps.dlrm.config import JobConfig, train_config
from apps.dlrm.model import EBC_PATH
from apps.dlrm.plan import preview
from apps.dlrm.training.app import DLRM

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

#: The memory of an 80 GB GPU (torch's total_memory of an H100 80 GB is a little more: 79.1 GiB).
GPU_BYTES = 80 * 10**9
ONE_GPU = DistEnv(
    rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cuda", 0), backend="nccl"
)
# 38 GiB of tables (8 x 10M rows x 128) for 8 GiB of HBM: some must be cached from host memory.
BIG_TABLES = dict(
    num_sparse_features=8, num_embeddings=10_000_000, embedding_dim=128, dense_arch_layer_sizes=[512, 256, 128]
)


def _hbm(topology) -> list[int]:
    return [device.storage.hbm for device in topology.devices]


def test_the_app_plans_with_the_gpus_memory_when_hbm_gb_is_0():
    assert _hbm(training_topology(JobConfig(), ONE_GPU, GPU_BYTES)) == [GPU_BYTES]


def test_the_app_plans_with_hbm_gb_when_given():
    env = DistEnv(
        rank=3, world_size=16, local_rank=3, local_world_size=8, device=torch.device("cuda", 3), backend="nccl"
    )
    topology = training_topology(train_config(hbm_gb=8.5), env, GPU_BYTES)
    assert (topology.world_size, topology.local_world_size, topology.compute_device) == (16, 8, "cuda")
    assert _hbm(topology) == [int(8.5 * GiB)] * 16


def test_hbm_gb_larger_than_the_gpu_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        training_topology(train_config(hbm_gb=80), ONE_GPU, GPU_BYTES)
    assert str(error.value) == (
        "--hbm_gb 80 is more than this GPU's 74.51 GiB: give at most that, or 0 to plan with the whole GPU"
    )


def test_hbm_gb_on_cpu_ranks_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"--hbm_gb 8 is for GPU ranks, but this job runs on cpu"):
        check_device_support(train_config(hbm_gb=8), "cpu")


def test_the_app_plans_the_tables_and_kernels_the_preview_predicts():
    cfg = train_config(**BIG_TABLES, hbm_gb=8)
    predicted = preview(cfg, PlanTarget(j="1x1", gpu=1, memMB=65536, hbm_gb=cfg.launch.hbm_gb).cluster)
    model, sharders = model_to_shard(DLRM, cfg, dense_device=torch.device("meta"))
    planned = make_planner(DLRM, cfg, model, training_topology(cfg, ONE_GPU, GPU_BYTES)).plan(model, sharders)
    assert plan_tables(planned) == plan_tables(predicted.plan)
    assert planned.plan[EBC_PATH] == predicted.plan.plan[EBC_PATH]  # shard sizes and offsets too
    kernels = [table["kernel"] for table in plan_tables(planned).values()]
    assert "fused_uvm_caching" in kernels, kernels
