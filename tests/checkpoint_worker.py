"""Trains and resumes the app in one process group, for the tests of checkpoints.

Run under torchrun by tests/integration/test_checkpoint.py and tests/integration/test_reshard.py:
    torchrun --nproc_per_node N tests/checkpoint_worker.py RUNS.json
RUNS.json lists runs, done in order, each ``{"args": [APP ARGS...]}`` or
``{"args": [...], "resume": [CHECKPOINT_DIR...], "dump": OUT_PREFIX}``. A run without "resume"
trains as the app's command does (apps.core.training.command.train: it saves a checkpoint to its
--checkpoint_dir). A run with it builds the app's model once and resumes it from each checkpoint
dir i in turn; rank r writes OUT_PREFIX.{i}.rank{r}.pt: the step, the plan and every tensor of
the model and optimizer state, as the pieces (offsets, values) the rank holds under its own
sharding. One process for many runs: starting torchrun and importing TorchRec take most of a
small run's time.
"""

import json
import sys

import torch
import torch.distributed as dist

from apps.core.checkpoint.checkpointer import Checkpointer, TrainState, open_checkpoints
from apps.core.common.distributed import DistEnv, init_distributed
from apps.core.training import command
from apps.dlrm.config import parse_train_config
from apps.dlrm.training.app import Trainer
from tests.shards import local_pieces


def resume_each(args: list[str], checkpoint_dirs: list[str], out_prefix: str, env: DistEnv) -> None:
    """Builds the app's model for ``args``, then resumes it from each of ``checkpoint_dirs``."""
    cfg = parse_train_config(args)
    trainer = Trainer(cfg, env)
    for i, checkpoint_dir in enumerate(checkpoint_dirs):
        cfg_i = cfg.replace(checkpoint_dir=checkpoint_dir)
        checkpointer = Checkpointer(
            cfg_i, env, open_checkpoints(cfg_i, env), trainer.checkpointed, trainer.run_length.steps
        )
        assert checkpointer.resume_from is not None, f"no checkpoint to resume from in {checkpoint_dir}"
        state = TrainState(env.rank)
        checkpointer.restore(state)
        torch.save(
            {
                "progress": state.progress(),
                "pieces": local_pieces(checkpointer.entries(state)),
                "plan": trainer.checkpointed.plan,
            },
            f"{out_prefix}.{i}.rank{env.rank}.pt",
        )
        checkpointer.close()
    trainer.close()


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    env = init_distributed()
    for spec in runs:
        if "resume" in spec:
            resume_each(spec["args"], spec["resume"], spec["dump"], env)
        else:
            command.train(Trainer(parse_train_config(spec["args"]), env))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
