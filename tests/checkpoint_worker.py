"""Resumes the app's training state from --checkpoint_dir and dumps what each rank then holds.

Run under torchrun by tests/test_checkpoint.py:
    torchrun --nproc_per_node N tests/checkpoint_worker.py OUT_PREFIX [APP ARGS...]
Rank r writes OUT_PREFIX.rank{r}.pt: every tensor of the model and optimizer state, as the
pieces (offsets, values) the rank holds under its own sharding.
"""

import sys

import torch
import torch.distributed as dist

from apps.dlrm.checkpoint import Checkpointer, TrainState
from apps.dlrm.config import parse_train_config
from apps.dlrm.distributed import init_distributed
from apps.dlrm.sharding import plan_tables
from apps.dlrm.train import build_training
from tests.shards import local_pieces


def main() -> None:
    out_prefix, *app_args = sys.argv[1:]
    cfg = parse_train_config(app_args)
    env = init_distributed()
    checkpointer = Checkpointer(cfg, env)
    assert checkpointer.resume_from is not None, "no checkpoint to resume from"
    run = build_training(cfg, env)
    checkpointer.track(run.model, run.optimizer, plan_tables(run.plan))
    state = TrainState(env.rank)
    checkpointer.restore(state)
    torch.save(
        {"progress": state.progress(), "pieces": local_pieces(checkpointer.entries(state)),
         "plan": plan_tables(run.plan)},
        f"{out_prefix}.rank{env.rank}.pt",
    )
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
