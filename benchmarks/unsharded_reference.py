"""The unsharded side of the equivalence check: the app's model trained in one process on each
step's global batch, through the kernels the sharded ranks run, with no sharding at all (no plan,
no all-to-all, no DDP, no pipeline).

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
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.training.optim import optimizer_class
from apps.dlrm.config import TrainConfig
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.model import build_model, table_configs
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
    """The model, its optimizers and its data, stepped one global batch at a time."""

    def __init__(self, cfg: TrainConfig, init: dict[str, torch.Tensor], world_size: int) -> None:
        if cfg.launch.sharding_type == "auto":  # the config admits only known types besides it
            raise ValueError(f"no reference for --sharding_type {cfg.launch.sharding_type}: name one sharding type")
        self.world_size = world_size
        self.train_module: DLRMTrain = build_model(cfg.model, dense_device=CPU, table_device=CPU)
        self.train_module.load_state_dict(init)
        self.per_block_tables = cfg.launch.sharding_type == "data_parallel"
        dense_cls, dense_kwargs = optimizer_class(cfg.training.dense_optimizer, cfg.training.dense_lr)
        dense = [p for name, p in self.train_module.named_parameters() if "sparse_arch" not in name]
        self.optimizers: list[torch.optim.Optimizer] = [dense_cls(dense, **dense_kwargs)]
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
        self.data = SyntheticClickLogs(cfg, rank=0, world_size=1)

    def step(self, step: int) -> float:
        """Trains on the global batch of 0-based ``step``; returns its loss as the ranks report it
        (their float32 losses averaged in float64)."""
        blocks = [self.data.block("train", b) for b in range(step * self.world_size, (step + 1) * self.world_size)]
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        losses = self._block_losses(blocks)
        (sum(losses) / self.world_size).backward()  # type: ignore[operator]
        for optimizer in self.optimizers:
            optimizer.step()
        return sum(loss.item() for loss in losses) / self.world_size

    def _block_losses(self, blocks: list[Batch]) -> list[torch.Tensor]:
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


def reference_losses(cfg: TrainConfig, init: dict[str, torch.Tensor], world_size: int, steps: int) -> list[float]:
    """The loss of each of ``steps`` steps of the unsharded reference from weights ``init``."""
    reference = UnshardedReference(cfg, init, world_size)
    return [reference.step(step) for step in range(steps)]
