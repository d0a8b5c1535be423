"""What several ranks' sharded step is spared of ours (issue 37, item 4): the data sources' KJTs
carry the sizes TorchRec's input distribution would read back from the device (no ``.tolist()``
or ``.item()`` in one ``input_dist``), and the DLRM's ``PooledSparseArch`` gives TorchRec's
``SparseArch``'s output without its ``to_dict`` and ``cat``.

The losses of whole runs with both, against the unsharded reference, are tests/integration/test_equivalence.py's.
"""

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import SparseArch
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.common.distributed import free_port
from apps.dlrm.config import parse_train_config
from apps.dlrm.model import PooledSparseArch, build_model
from apps.hstu.config import HSTUModelConfig
from apps.hstu.data.batch import SequenceBatch, candidate_batch
from apps.hstu.model import table_configs as hstu_table_configs
from tests.unit.test_synthetic import synthetic

# Tier (tests/conftest.py): in this process, a world of one rank, seconds.
TIER = "unit"

#: Three sparse features of 2, 1 and 3 ids a sample (multi-hot), eight samples.
DLRM_ARGS = ["--num_sparse_features", "3", "--num_embeddings", "50", "--embedding_dim", "4"]
DLRM_ARGS += ["--multi_hot_sizes", "2,1,3", "--batch_size", "8", "--dense_arch_layer_sizes", "8,4"]


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class HostReads(TorchFunctionMode):
    """Counts the reads of a tensor's values into Python (a device-to-host sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("tolist", "item"):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def host_reads_of_input_dist(sharded: Any, features: Callable[[], KeyedJaggedTensor]) -> list[str]:
    """The host reads of one input distribution by ``sharded`` (a sharded table module) of a new
    batch of ``features()`` (a KJT caches what it read), all of it waited for; a first,
    uncounted one sets up TorchRec's caches."""

    def distribute() -> None:
        awaitable = sharded.input_dist(sharded.create_context(), features())
        while hasattr(awaitable, "wait"):
            awaitable = awaitable.wait()

    distribute()
    with HostReads() as mode:
        distribute()
    return mode.reads


def on_one_rank(model: nn.Module, path: str, kinds: dict[str, Any], sharder: Any) -> DistributedModelParallel:
    """``model`` with the table module at ``path`` sharded on this one rank as ``kinds`` says."""
    plan = construct_module_sharding_plan(model.get_submodule(path), kinds, sharder=sharder, local_size=1, world_size=1)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({path: plan}), sharders=[sharder], init_data_parallel=False
    )


def dlrm(kinds: dict[str, Any]) -> DistributedModelParallel:
    cfg = parse_train_config(DLRM_ARGS)
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"))
    return on_one_rank(model, "model.sparse_arch.embedding_bag_collection", kinds, EmbeddingBagCollectionSharder())


def synthetic_features() -> KeyedJaggedTensor:
    cfg = parse_train_config(DLRM_ARGS)
    return synthetic(cfg).block("train", 0).sparse_features


def without_sizes(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` as a KJT of its keys, values and lengths alone."""
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=features.lengths())


def test_synthetic_batches_cost_the_input_distribution_no_host_read(one_rank):
    tables = dlrm(
        {f"t_cat_{i}": table_wise(rank=0) for i in range(3)}
    ).module.model.sparse_arch.embedding_bag_collection
    assert host_reads_of_input_dist(tables, synthetic_features) == []
    # What the batch's sizes spare: a KJT of lengths alone reads them back.
    assert host_reads_of_input_dist(tables, lambda: without_sizes(synthetic_features())) != []


def test_hstu_batches_and_candidates_cost_the_input_distribution_no_host_read(one_rank):
    cfg = HSTUModelConfig(num_items=30, num_actions=4, embedding_dim=8)
    model = nn.Module()
    model.tables = EmbeddingCollection(tables=hstu_table_configs(cfg), device=torch.device("meta"))
    kinds = {"item_table": table_wise(rank=0), "action_table": table_wise(rank=0)}
    tables = on_one_rank(model, "tables", kinds, EmbeddingCollectionSharder()).module.tables
    batch = lambda: SequenceBatch.of(  # noqa: E731
        items=torch.arange(6),
        actions=torch.arange(6) % 4,
        timestamps=torch.arange(6),
        lengths=torch.tensor([3, 1, 2]),
        negatives=torch.arange(6).view(3, 2) + 10,
    )
    for features in (lambda: batch().features, lambda: candidate_batch(torch.arange(5), num_users=3)):
        assert features().length_per_key() == without_sizes(features()).length_per_key()
        assert host_reads_of_input_dist(tables, features) == []


def test_pooled_sparse_arch_gives_torchrecs_output_and_gradients_exactly(one_rank):
    # Table-wise and data-parallel tables mixed: the pooled keys come in another order than the
    # features', so the output is a gather of them.
    kinds = {"t_cat_0": data_parallel(), "t_cat_1": table_wise(rank=0), "t_cat_2": data_parallel()}
    ours, theirs = dlrm(kinds), dlrm(kinds)
    theirs.module.model.sparse_arch.__class__ = SparseArch
    assert isinstance(ours.module.model.sparse_arch, PooledSparseArch)
    outputs = []
    for model in (ours, theirs):
        arch = model.module.model.sparse_arch
        output = arch(synthetic_features())
        (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
        grads = {name: p.grad for name, p in arch.named_parameters() if p.grad is not None}
        outputs.append((output.detach(), grads))
    (got, got_grads), (expected, expected_grads) = outputs
    pooled = ours.module.model.sparse_arch.embedding_bag_collection(synthetic_features())
    assert pooled.keys() == ["cat_0", "cat_2", "cat_1"]  # data-parallel first: the gather ran
    assert torch.equal(got, expected) and got.shape == (8, 3, 4)
    assert sorted(got_grads) == sorted(expected_grads) and len(got_grads) == 3  # every table
    for name, grad in expected_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert list(ours.state_dict()) == list(theirs.state_dict())
