"""The unsharded side of the equivalence check: an app's model trained in one process on each
step's global batch, through the kernels the sharded ranks run, with no sharding at all (no plan,
no all-to-all, no DDP, no pipeline). :class:`UnshardedReference` is the step every app shares;
:class:`DLRMReference` and :class:`HSTUReference` say how each app's blocks are looked up and lost.

Which kernels those are depends on the sharding type, because the type picks them:

- table_wise, row_wise, column_wise, table_row_wise: FBGEMM's table-batched embeddings with the
  embedding optimizer fused into backward. Here: TorchRec's unsharded
  ``FusedEmbeddingBagCollection`` (TorchRec's own mapping from the optimizer class to FBGEMM's),
  looked up once over the global batch -- the ranks' blocks in rank order, as the shard owners
  receive them -- with the gradient of the mean of the blocks' losses, as the sharded tables get.
- data_parallel: each rank holds whole tables as plain weights, looks up its own block, DDP
  averages the gradients and the ``torch.optim`` embedding optimizer steps. Here: the same
  weights as ``OrderedEmbeddingBag`` (FBGEMM's dense-kernel arithmetic), looked up block by
  block, and the same optimizer.

The dense part is the same for every type: each block through the MLPs on its own, and the
gradient of the blocks' mean loss, which is exactly DDP's average of the ranks' gradients.

The HSTU's tables are an ``EmbeddingCollection`` (one vector per id, no pooling), which every
sharding type it admits looks up with FBGEMM's table-batched kernel in sequence mode and the
optimizer fused into backward. TorchRec's unsharded ``FusedEmbeddingCollection`` refuses the
CPU, so the reference builds that FBGEMM kernel itself (:class:`FusedSequenceTables`) with
TorchRec's mapping of the optimizer. Its blocks must stay apart past the lookup: the retrieval
loss's in-batch negatives are the other users of the block, so each block is encoded and lost on
its own, exactly as on its rank.

Why not ``nn.EmbeddingBag`` and ``torch.optim`` for the tables, as this reference once had:
float32 sums depend on their order. torch's CPU ``embedding_bag`` backward adds a row's
gradients in an order that depends on the CPU's vector width, and FBGEMM's fused row-wise
Adagrad runs its own JIT-compiled kernel. On an AMD EPYC with AVX-512 that left table elements
one ulp apart after the first step. Adagrad then gave near-zero gradients full-sized updates and
carried the difference to 4e-4 in the loss by step 17, with the same gap for every sharding type,
because the reference was the side that differed. With the same kernels on both sides, the
check is exact on any CPU and tests sharding alone.
"""

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection, convert_optimizer_type_and_kwargs
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from apps.core.config import SharedSections
from apps.core.data import RankShare
from apps.core.training.optim import optimizer_class
from apps.dlrm.config import JobConfig
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.model import build_model, table_configs
from apps.hstu import config as hstu_config
from apps.hstu import model as hstu_model
from apps.hstu.data import make_dataset
from apps.hstu.data.batch import SequenceBatch
from benchmarks.ordered_bags import order_tables_as_fbgemm

CPU = torch.device("cpu")


def global_batch(blocks: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The blocks' sparse features as one batch: block 0's samples, then block 1's, ..."""
    keys = blocks[0].keys()
    features = [block.to_dict() for block in blocks]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([f[key].values() for key in keys for f in features]),
        lengths=torch.cat([f[key].lengths() for key in keys for f in features]),
    )


class UnshardedReference:
    """An app's model, its optimizers and its data, stepped one global batch (the ranks' blocks)
    at a time; a subclass makes the model, optimizers and data (:meth:`block`, :meth:`block_losses`)."""

    def __init__(self, cfg: SharedSections, world_size: int) -> None:
        if cfg.launch.sharding_type == "auto":  # the config admits only known types besides it
            raise ValueError(f"no reference for --sharding_type {cfg.launch.sharding_type}: name one sharding type")
        self.world_size = world_size
        self.optimizers: list[torch.optim.Optimizer] = []

    def add_dense_optimizer(self, cfg: SharedSections, model: nn.Module, tables_path: str) -> None:
        """The dense optimizer (as the ranks' ``dense`` group) over every parameter outside the tables."""
        cls, kwargs = optimizer_class(cfg.training.dense_optimizer, cfg.training.dense_lr)
        dense = [p for name, p in model.named_parameters() if not name.startswith(f"{tables_path}.")]
        self.optimizers.append(cls(dense, **kwargs))

    def block(self, index: int) -> Batch | SequenceBatch:
        """Training block ``index``: what rank ``index % world_size`` trains on at step ``index // world_size``."""
        raise NotImplementedError

    def block_losses(self, blocks: list) -> list[torch.Tensor]:
        """Each block's loss, as its rank computes it."""
        raise NotImplementedError

    def step(self, step: int) -> float:
        """Trains on the global batch of 0-based ``step``; returns its loss as the ranks report it
        (their float32 losses averaged in float64)."""
        blocks = [self.block(b) for b in range(step * self.world_size, (step + 1) * self.world_size)]
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        losses = self.block_losses(blocks)
        (sum(losses) / self.world_size).backward()  # type: ignore[operator]
        for optimizer in self.optimizers:
            optimizer.step()
        return sum(loss.item() for loss in losses) / self.world_size


class DLRMReference(UnshardedReference):
    """The DLRM: its tables fused (or, data_parallel, plain weights with the table optimizer)."""

    def __init__(self, cfg: JobConfig, init: dict[str, torch.Tensor], world_size: int) -> None:
        super().__init__(cfg, world_size)
        self.train_module: DLRMTrain = build_model(cfg.model, dense_device=CPU, table_device=CPU)
        self.train_module.load_state_dict(init)
        self.per_block_tables = cfg.launch.sharding_type == "data_parallel"
        self.add_dense_optimizer(cfg, self.train_module, "model.sparse_arch")
        table_cls, table_kwargs = optimizer_class(cfg.training.embedding_optimizer, cfg.training.learning_rate)
        sparse_arch = self.train_module.model.sparse_arch
        if self.per_block_tables:
            order_tables_as_fbgemm(sparse_arch)
            self.optimizers.append(table_cls(list(sparse_arch.parameters()), **table_kwargs))
        else:
            fused = FusedEmbeddingBagCollection(
                tables=table_configs(cfg.model), optimizer_type=table_cls, optimizer_kwargs=table_kwargs, device=CPU
            )
            fused.load_state_dict(sparse_arch.embedding_bag_collection.state_dict())
            sparse_arch.embedding_bag_collection = fused
        self.data = SyntheticClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training))

    def block(self, index: int) -> Batch:
        return self.data.block("train", index)

    def block_losses(self, blocks: list[Batch]) -> list[torch.Tensor]:
        """Each block's loss: DLRM's forward with the tables looked up as the sharding type does."""
        dlrm = self.train_module.model
        if self.per_block_tables:
            pooled = torch.cat([dlrm.sparse_arch(block.sparse_features) for block in blocks])
        else:
            pooled = dlrm.sparse_arch(global_batch([block.sparse_features for block in blocks]))
        losses, start = [], 0
        for block in blocks:
            rows = slice(start, start + len(block.labels))
            start = rows.stop
            dense = dlrm.dense_arch(block.dense_features)
            logits = dlrm.over_arch(dlrm.inter_arch(dense_features=dense, sparse_features=pooled[rows]))
            losses.append(self.train_module.loss_fn(logits.squeeze(-1), block.labels))
        return losses


class FusedSequenceTables(nn.Module):
    """An unsharded ``EmbeddingCollection`` whose optimizer is fused into backward: FBGEMM's
    table-batched kernel in sequence mode (``PoolingMode.NONE``), one vector per id."""

    def __init__(self, tables: list[EmbeddingConfig], optimizer: type[torch.optim.Optimizer], kwargs: dict) -> None:
        super().__init__()
        converted = convert_optimizer_type_and_kwargs(optimizer, kwargs)
        if converted is None:
            raise ValueError(f"FBGEMM has no fused {optimizer.__name__}")
        fused_type, fused_kwargs = converted
        #: The features in the kernel's order: each table's, table after table.
        self.features = [feature for table in tables for feature in table.feature_names]
        self.names = [table.name for table in tables]
        self.kernel = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
            feature_table_map=[i for i, table in enumerate(tables) for _ in table.feature_names],
            pooling_mode=PoolingMode.NONE,
            device=CPU,
            optimizer=fused_type,
            **fused_kwargs,
        )

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies the tables' weights, by table name."""
        with torch.no_grad():
            for name, weight in zip(self.names, self.kernel.split_embedding_weights()):
                weight.copy_(weights[name])

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        ordered = features.permute([features.keys().index(feature) for feature in self.features])
        embeddings = self.kernel(indices=ordered.values(), offsets=ordered.offsets())
        lengths = ordered.length_per_key()
        return {
            feature: JaggedTensor(values=values, lengths=ordered[feature].lengths())
            for feature, values in zip(self.features, embeddings.split(lengths))
        }


def split_blocks(looked_up: dict[str, JaggedTensor], users: list[int]) -> list[dict[str, JaggedTensor]]:
    """A global batch's looked-up features, back into its blocks of ``users`` users each."""
    blocks: list[dict[str, JaggedTensor]] = [{} for _ in users]
    for feature, jagged in looked_up.items():
        lengths = jagged.lengths().split(users)
        values = jagged.values().split([int(block_lengths.sum()) for block_lengths in lengths])
        for block, block_values, block_lengths in zip(blocks, values, lengths):
            block[feature] = JaggedTensor(values=block_values, lengths=block_lengths)
    return blocks


class HSTUReference(UnshardedReference):
    """The HSTU: its tables fused and looked up once over the global batch, as the shard owners
    receive it; each block encoded and lost on its own."""

    def __init__(self, cfg: hstu_config.JobConfig, init: dict[str, torch.Tensor], world_size: int) -> None:
        super().__init__(cfg, world_size)
        self.train_module = hstu_model.build_model(cfg.model, dense_device=CPU, table_device=CPU)
        self.train_module.load_state_dict(init)
        hstu = self.train_module.model
        self.add_dense_optimizer(cfg, hstu, "embedding_collection")
        table_cls, table_kwargs = optimizer_class(cfg.training.embedding_optimizer, cfg.training.learning_rate)
        configs = hstu_model.table_configs(cfg.model)
        self.tables = FusedSequenceTables(configs, table_cls, table_kwargs)
        self.tables.load({t.name: hstu.embedding_collection.embeddings[t.name].weight for t in configs})
        self.data = make_dataset(cfg.model, cfg.data, RankShare.of(cfg.training), CPU)

    def block(self, index: int) -> SequenceBatch:
        return self.data.batch("train", index)

    def block_losses(self, blocks: list[SequenceBatch]) -> list[torch.Tensor]:
        hstu = self.train_module.model
        looked_up = self.tables(global_batch([block.features for block in blocks]))
        per_block = split_blocks(looked_up, [block.num_users for block in blocks])
        return [hstu.loss(hstu.encoder(lookups, block, block.features)) for lookups, block in zip(per_block, blocks)]
