"""The training job's own scores of a split: what an exported model's scores are held against.

:func:`evaluation_scores` restores a checkpoint into the sharded model a training run builds
(:class:`~apps.dlrm.training.app.Trainer`, with ``--evaluate_checkpoint``) and runs its
evaluation loop over a split's batches, as ``Trainer.evaluate`` does, keeping every row's
probability instead of only the metrics. In one process, the rows come in the split's order.

    python -m testing.training_scores --out scores.npz <the training run's options> \\
        --evaluate_checkpoint best
"""

import argparse
import contextlib
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from apps.core.common.distributed import init_distributed
from apps.core.common.teardown import exit_without_teardown
from apps.dlrm.config import JobConfig, parse_train_config
from apps.dlrm.training.app import Trainer


def evaluation_scores(cfg: JobConfig, split: str = "test") -> tuple[np.ndarray, np.ndarray, float, float]:
    """Collective: (probabilities, labels, wall and CPU seconds of the evaluation loop) of this
    rank's rows of ``split`` (all of it: --test_batches 0), by the model of ``cfg``'s
    --evaluate_checkpoint. CPU seconds are this process's, every thread's (the loader's too)."""
    env = init_distributed()
    trainer = Trainer(cfg, env)
    try:
        trainer.load(trainer.checkpointer.named(cfg.evaluation.evaluate_checkpoint))
        model = trainer.model.eval()  # the pipeline has not started: the sharded model is as evaluate() runs it
        scores, labels = [], []
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad(), contextlib.closing(trainer.data.eval_batches(split, 0)) as batches:
            for batch in batches:
                _, (_, logits, batch_labels) = model(batch.to(env.device))
                scores.append(torch.sigmoid(logits.reshape(-1).float()).cpu().numpy())
                labels.append(batch_labels.reshape(-1).cpu().numpy())
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        trainer.close()
    return np.concatenate(scores), np.concatenate(labels), seconds, cpu


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", default="test")
    known, train_args = parser.parse_known_args(argv)
    cfg = parse_train_config(train_args)
    scores, labels, seconds, cpu = evaluation_scores(cfg, known.split)
    np.savez(known.out, scores=scores, labels=labels, seconds=seconds, cpu_seconds=cpu)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(lambda: main(sys.argv[1:]))
