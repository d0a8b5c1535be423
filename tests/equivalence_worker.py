"""Trains the app's sharded model from given initial weights and records the loss of each step.

Run under torchrun by tests/test_equivalence.py:
    torchrun --nproc_per_node 2 tests/equivalence_worker.py INIT.pt OUT.json STEPS [APP ARGS...]
"""

import json
import sys

import torch
import torch.distributed as dist

from apps.dlrm.config import parse_train_config
from apps.dlrm.distributed import all_reduce_mean, init_distributed
from apps.dlrm.model import EBC_PATH
from apps.dlrm.train import build_training
from tests.shards import copy_into


def main() -> None:
    init_path, out_path, steps, *app_args = sys.argv[1:]
    cfg = parse_train_config(app_args)
    env = init_distributed()
    run = build_training(cfg, env)
    copy_into(run.model, torch.load(init_path))
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
