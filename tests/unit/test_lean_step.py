"""The lean single-rank step (apps/core/training/lean.py): which runs take it, and its direct
lookup against the sharded module's own forward.

Its losses against TorchRec's sharded step and the unsharded reference, one-hot and multi-hot,
are tests/integration/test_equivalence.py's; the benchmark that measures it is tests/integration/test_benchmarks.py's.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.distributed import free_port
from apps.core.common.tables import Tables
from apps.core.config import LaunchConfig
from apps.core.training.lean import call_tables_directly, lean_step_refusal, step_kind

# Tier (tests/conftest.py): in this process, a world of one rank, seconds.
TIER = "unit"

TABLES = Tables.of("tables", "EmbeddingBagCollection")
#: Table i has feature f{i}; the plan mixes the two kinds, so the lookups take the features in
#: another order than the batch has them (table-wise ones first, or data-parallel ones).
KINDS = {"t0": table_wise(rank=0), "t1": data_parallel(), "t2": table_wise(rank=0), "t3": data_parallel()}


@pytest.mark.parametrize(
    "options, sharding_types, world_size, tables, refusal",
    [
        ({}, ["table_wise", "data_parallel"], 1, TABLES, ""),
        (dict(pipeline="base"), ["table_wise"], 1, TABLES, ""),
        (dict(lean_step="false"), ["table_wise"], 1, TABLES, "--lean_step false"),
        ({}, ["table_wise"], 2, TABLES, "2 ranks"),
        ({}, ["table_wise", "row_wise", "column_wise"], 1, TABLES, "column_wise/row_wise tables"),
        (dict(pipeline="prefetch"), ["table_wise"], 1, TABLES, "--pipeline prefetch"),
        (
            {},
            ["table_wise"],
            1,
            Tables.of("model.tables", "EmbeddingCollection"),
            "the tables are an EmbeddingCollection, which the lean step does not look up",
        ),
    ],
)
def test_the_lean_step_runs_on_one_rank_with_whole_tables_and_says_why_not(
    options, sharding_types, world_size, tables, refusal
):
    assert lean_step_refusal(LaunchConfig(**options), tables, sharding_types, world_size) == refusal
    kind = step_kind(refusal, "TrainPipelineSparseDist")
    assert kind.startswith("lean (one rank") if not refusal else kind.endswith(f"not the lean one: {refusal}")


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_tables(pooling: PoolingType) -> DistributedModelParallel:
    """Four tables on one rank, two table-wise (fused row-wise Adagrad), two data-parallel, in
    DMP without DDP as the lean step has them; the same weights each time."""
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=20 + i, feature_names=[f"f{i}"], pooling=pooling
        )
        for i in range(4)
    ]
    model = nn.Module()
    model.tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.tables.parameters(), {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(model.tables, KINDS, sharder=sharder, local_size=1, world_size=1)
    torch.manual_seed(0)
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"tables": plan}),
        sharders=[sharder],
        init_data_parallel=False,
    )


def batch() -> KeyedJaggedTensor:
    """Eight samples, several ids per sample in some features and none in some samples."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (4 * 8,), generator=generator)
    values = torch.cat([torch.randint(0, 20, (int(n),), generator=generator) for n in lengths])
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths)


def train_once(model: DistributedModelParallel, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """One forward and backward through ``model``'s tables: each feature's pooled embeddings, the
    tables after the fused update, the data-parallel tables' gradients."""
    pooled = model.module.tables(features).to_dict()
    weights = torch.linspace(-1, 1, 8)
    sum(((pooled[f"f{i}"] * weights).sum() * (i + 1) for i in range(4)), torch.tensor(0.0)).backward()
    state = {
        name: tensor.local_shards()[0].tensor if hasattr(tensor, "local_shards") else tensor
        for name, tensor in model.state_dict().items()
    }
    grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    return {
        **{f"pooled {name}": value.detach() for name, value in pooled.items()},
        **state,
        **{f"grad {n}": g for n, g in grads.items()},
    }


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_direct_lookup_gives_the_sharded_modules_embeddings_updates_and_gradients(one_rank, pooling):
    sharded, lean = sharded_tables(pooling), sharded_tables(pooling)
    call_tables_directly(lean.module, TABLES)
    assert lean.module.tables.forward.feature_names != batch().keys()  # the lookups' order is another
    expected, got = train_once(sharded, batch()), train_once(lean, batch())
    assert sorted(got) == sorted(expected) and sum(name.startswith("grad ") for name in got) == 2
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
