"""Trains the app's sharded model from given initial weights and records the loss of each step.

Run under torchrun by tests/test_equivalence.py:
    torchrun --nproc_per_node 2 tests/equivalence_worker.py INIT.pt OUT.json STEPS [APP ARGS...]
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from apps.dlrm.config import parse_train_config
from apps.dlrm.distributed import all_reduce_mean, init_distributed
from apps.dlrm.model import EBC_PATH
from apps.dlrm.train import build_training


def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies unsharded weights into this rank's shards (and its dense replicas)."""
    state = model.state_dict()
    assert set(state) == set(full), sorted(set(state) ^ set(full))
    with torch.no_grad():
        for name, tensor in state.items():
            if isinstance(tensor, ShardedTensor):
                for shard in tensor.local_shards():
                    rows, cols = shard.metadata.shard_offsets
                    h, w = shard.metadata.shard_sizes
                    shard.tensor.copy_(full[name][rows : rows + h, cols : cols + w])
            else:
                tensor.copy_(full[name])


def main() -> None:
    init_path, out_path, steps, *app_args = sys.argv[1:]
    cfg = parse_train_config(app_args)
    env = init_distributed()
    run = build_training(cfg, env)
    load_full_weights(run.model, torch.load(init_path))
    batches = run.data.train_batches()
    losses = []
    for _ in range(int(steps)):
        loss, _, _ = run.pipeline.progress(batches)
        losses.append(all_reduce_mean(loss.item(), env))
    if env.is_main:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "plan": [s.sharding_type for s in run.plan.plan[EBC_PATH].values()]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
