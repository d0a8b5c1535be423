"""The baseline of benchmarks/train_throughput.py: a minimal loop written with plain TorchRec.

It is what users write today from TorchRec's examples (golden_training/train_dlrm.py): the same
DLRM, RowWiseAdagrad fused into backward, DMP with TorchRec's default planner,
TrainPipelineSparseDist, TF32 as the app's --allow_tf32, on the same synthetic batches as the
app (made on the rank's device, so that neither side waits for its input). Run under torchrun with the
app's options; rank 0 prints one JSON line with the samples/s of the training loop.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from apps.core.common.teardown import exit_without_teardown
from apps.core.data import RankShare
from apps.core.training.precision import set_tf32
from apps.dlrm.config import JobConfig, parse_train_config
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.model import table_configs


def start(cfg: JobConfig) -> tuple[torch.device, int, int]:
    """Joins torchrun's process group: this rank's device (its GPU, TF32 as the app's
    --allow_tf32, or the CPU), rank and world size."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_tf32(cfg.launch.allow_tf32)
    return device, rank, world


def plain_pipeline(cfg: JobConfig, device: torch.device) -> TrainPipelineSparseDist:
    """The loop's model, sharded by TorchRec's default planner, in its train pipeline."""
    torch.manual_seed(cfg.training.seed)
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables=table_configs(cfg.model), device=torch.device("meta")
            ),
            dense_in_features=cfg.model.num_dense_features,
            dense_arch_layer_sizes=cfg.model.dense_arch_layer_sizes,
            over_arch_layer_sizes=cfg.model.over_arch_layer_sizes,
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(
        RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": cfg.training.learning_rate}
    )
    model = DistributedModelParallel(module=model, device=device, sharders=[EmbeddingBagCollectionSharder()])
    optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=cfg.training.dense_lr),
    )
    return TrainPipelineSparseDist(model, optimizer, device)


def main() -> None:
    cfg = parse_train_config(sys.argv[1:])
    device, rank, world = start(cfg)
    pipeline = plain_pipeline(cfg, device)
    batches = SyntheticClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training, rank, world), device).train_batches()
    start_time = time.perf_counter()
    for _ in range(cfg.training.steps):
        loss, _, _ = pipeline.progress(batches)
    loss.item()  # wait for the last step
    seconds = time.perf_counter() - start_time
    if rank == 0:
        print(json.dumps({"samples_per_sec": cfg.training.steps * cfg.training.batch_size * world / seconds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(main)
