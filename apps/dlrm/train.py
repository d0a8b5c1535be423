"""Train, validate and test a sharded DLRM: ``python -m apps.dlrm.train --help``.

The recipe: build the model on the meta device, fuse the embedding optimizer into backward,
plan and shard the tables across ranks, then step TorchRec's training pipeline, validate and
test with metrics synced across ranks, and write summary.json.
"""

import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineSparseDist, train_pipelines
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.checkpoint import Checkpointer, TrainState
from apps.dlrm.common.distributed import DistEnv, all_reduce_mean, init_distributed
from apps.dlrm.common.errors import ConfigError
from apps.dlrm.config import TrainConfig, parse_train_config
from apps.dlrm.data import ClickLogs, make_dataset
from apps.dlrm.device_support import check_device_support
from apps.dlrm.metrics import EvalMetrics, Stopwatch, Throughput
from apps.dlrm.model import speed_up_dense
from apps.dlrm.optim import LRSchedule, training_optimizer
from apps.dlrm.report import Reporter, setup_logging
from apps.dlrm.sharding import build_plan, describe_plan, model_to_shard, plan_tables, shard_model
from apps.dlrm.urls import config_record

logger = logging.getLogger("apps.dlrm")


#: --pipeline -> TorchRec's class of that name (torchrec.distributed.train_pipeline).
PIPELINE_CLASSES = {
    "sparse_dist": "TrainPipelineSparseDist",
    "base": "TrainPipelineBase",
    "semi_sync": "TrainPipelineSemiSync",
    "fused_sparse_dist": "TrainPipelineFusedSparseDist",
    "sparse_dist_lite": "TrainPipelineSparseDistLite",
    "prefetch": "PrefetchTrainPipelineSparseDist",
}


def pipeline_class(cfg: TrainConfig) -> type[TrainPipeline]:
    """TorchRec's pipeline class that --pipeline names, if this TorchRec has it."""
    name = PIPELINE_CLASSES[cfg.pipeline]
    cls = getattr(train_pipelines, name, None)
    if cls is None:
        raise ConfigError(
            f"--pipeline {cfg.pipeline} needs TorchRec's {name}, which torchrec "
            f"{torchrec.__version__} does not have: upgrade torchrec or use --pipeline sparse_dist"
        )
    return cls


def evaluate(
    model: nn.Module,
    batches: Generator[Batch, None, None],
    env: DistEnv,
    teacher: Callable[[Batch], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Metrics of ``model`` over this rank's ``batches``, gathered over all ranks."""
    metrics = EvalMetrics(env.device, with_teacher=teacher is not None)
    was_training = model.training
    model.eval()
    with torch.no_grad(), contextlib.closing(batches):
        for batch in batches:
            teacher_logits = teacher(batch) if teacher is not None else None
            _, (_, logits, labels) = model(batch.to(env.device))
            metrics.update(logits, labels, teacher_logits)
    model.train(was_training)
    return metrics.compute()


@contextlib.contextmanager
def pipeline_paused(pipeline: TrainPipeline) -> Iterator[nn.Module]:
    """Gives back the plain model while the pipeline's in-flight batches wait."""
    if isinstance(pipeline, TrainPipelineSparseDist):
        yield pipeline.detach()
        pipeline.attach()
    else:
        yield pipeline._model


@dataclass
class Training:
    """Everything a training run steps: the sharded model, its optimizers, pipeline and data."""

    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    schedule: LRSchedule
    pipeline: TrainPipeline
    plan: ShardingPlan
    data: ClickLogs


def build_training(cfg: TrainConfig, env: DistEnv) -> Training:
    """Opens the data (a bad --data_path fails in seconds), then builds, plans and shards the model."""
    check_device_support(cfg, env.device)
    pipeline_cls = pipeline_class(cfg)
    data = make_dataset(cfg, env)
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
    # Same seed on every rank: DDP needs identical dense weights to start from.
    torch.manual_seed(cfg.seed)
    model, sharder = model_to_shard(cfg, dense_device=env.device)
    speed_up_dense(cfg, model, env.device)
    plan = build_plan(cfg, model, sharder, env)
    sharded = shard_model(model, plan, sharder, env)
    optimizer = training_optimizer(cfg, sharded)
    pipeline = pipeline_cls(sharded, optimizer, env.device)
    return Training(sharded, optimizer, LRSchedule(cfg, optimizer), pipeline, plan, data)


def evaluate_split(run: Training, split: str, num_batches: int, env: DistEnv) -> dict[str, float]:
    """Metrics on this split (with the teacher's ceiling on validation data that has one)."""
    teacher = run.data.teacher() if split == "val" else None
    with pipeline_paused(run.pipeline) as plain_model:
        return evaluate(plain_model, run.data.eval_batches(split, num_batches), env, teacher)


def fit(
    cfg: TrainConfig,
    env: DistEnv,
    run: Training,
    state: TrainState,
    checkpointer: Checkpointer,
    reporter: Reporter,
) -> Throughput:
    """Trains from ``state.step`` to ``cfg.steps``, validating and checkpointing on the way.

    Updates ``state`` (step, last training loss) in place; returns the training throughput.
    """
    global_batch = cfg.batch_size * env.world_size
    throughput, window_meter = Throughput(), Throughput()
    window: list[torch.Tensor] = []
    reporter.progress(total=cfg.steps, initial=state.step)
    stopwatch = Stopwatch()
    # Closed when training ends or fails: a data loader's threads must not outlive it.
    with contextlib.closing(run.data.train_batches(start_step=state.step)) as batches:
        for step in range(state.step + 1, cfg.steps + 1):
            run.schedule.apply(step - 1)
            loss, _, _ = run.pipeline.progress(batches)
            window.append(loss)
            state.step = step
            checkpoint_due = checkpointer.due(step)
            log_due = step % cfg.log_every == 0 or step == cfg.steps or checkpoint_due
            # The only host sync of a training step, on log steps: it waits for the device to
            # finish, so that the lap below times work done, not work queued.
            window_losses = torch.stack(window).tolist() if log_due else []
            elapsed = stopwatch.lap()
            throughput.add(elapsed, global_batch)
            window_meter.add(elapsed, global_batch)
            if log_due:
                state.train_loss = all_reduce_mean(window_losses[-1], env)
                window_loss = all_reduce_mean(sum(window_losses) / len(window_losses), env)
                reporter.scalars("train", {"loss": window_loss, "samples_per_sec": window_meter.samples_per_sec}, step)
                reporter.log(
                    "step %d/%d  loss %.4f  %.0f samples/s",
                    step,
                    cfg.steps,
                    window_loss,
                    window_meter.samples_per_sec,
                )
                window, window_meter = [], Throughput()
                reporter.step(loss=window_loss)
            else:
                reporter.step()
            if cfg.validate_every and step % cfg.validate_every == 0 and step < cfg.steps:
                val = evaluate_split(run, "val", cfg.val_batches, env)
                reporter.scalars("val", val, step)
                reporter.log("step %d validation: %s", step, _fmt_metrics(val))
            if checkpoint_due:
                url = checkpointer.save(state)
                reporter.log(
                    "step %d: checkpoint taken for %s (training stopped %.2f s)", step, url, checkpointer.stalls[-1]
                )
            stopwatch.lap()  # validation and checkpoint time is not training time
    reporter.close_progress()
    return throughput


def train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    """The whole run: resume or start, train, validate and test, and write summary.json."""
    reporter = Reporter(cfg.output_dir, enabled=env.is_main)
    checkpointer = Checkpointer(cfg, env)  # before the model: a bad --checkpoint_dir fails in seconds
    run = build_training(cfg, env)
    checkpointer.track(run.model, run.optimizer, plan_tables(run.plan))
    try:
        return _train(cfg, env, run, checkpointer, reporter)
    finally:
        checkpointer.close()  # the last save, still being written, commits before the job ends


def _train(
    cfg: TrainConfig, env: DistEnv, run: Training, checkpointer: Checkpointer, reporter: Reporter
) -> dict[str, Any]:
    reporter.log("sharding plan (%s):\n%s", cfg.sharding_type, describe_plan(run.plan))
    state = TrainState(env.rank)
    resumed = checkpointer.restore(state)
    if resumed is not None:
        reporter.log("resumed from %s (step %d)", resumed.url, state.step)
    reporter.log(
        "training steps %d..%d of %d samples x %d ranks on %s (%s)",
        state.step + 1,
        cfg.steps,
        cfg.batch_size,
        env.world_size,
        env.device.type,
        env.backend,
    )
    throughput = fit(cfg, env, run, state, checkpointer, reporter)

    val = evaluate_split(run, "val", cfg.val_batches, env)
    test = evaluate_split(run, "test", cfg.test_batches, env)
    reporter.scalars("val", val, cfg.steps)
    reporter.scalars("test", test, cfg.steps)
    reporter.log("validation: %s", _fmt_metrics(val))
    reporter.log("test: %s", _fmt_metrics(test))
    checkpointer.wait()
    summary: dict[str, Any] = {
        "val_auroc": val["auroc"],
        "val_log_loss": val["log_loss"],
        "val_accuracy": val["accuracy"],
        "auroc_ceiling": val.get("auroc_ceiling"),
        "test_auroc": test["auroc"],
        "test_log_loss": test["log_loss"],
        "test_accuracy": test["accuracy"],
        "final_train_loss": state.train_loss,
        "resumed_from_step": resumed.step if resumed else None,
        "samples_per_sec": throughput.samples_per_sec,
        "train_seconds": throughput.seconds,
        "steps": state.step,
        "world_size": env.world_size,
        "global_batch_size": cfg.batch_size * env.world_size,
        "device": env.device.type,
        "backend": env.backend,
        "peak_hbm_bytes": peak_hbm_bytes(env),
        "checkpoint_stall_seconds": checkpointer.stalls,
        "checkpoint_wait_seconds": checkpointer.waits,
        "sharding_plan": describe_plan(run.plan).splitlines(),
        "config": config_record(cfg),
    }
    path = reporter.write_summary(summary)
    if path:
        reporter.log("wrote %s", path)
    reporter.close()
    return summary


def peak_hbm_bytes(env: DistEnv) -> int | None:
    """The most GPU memory any rank's tensors took at once (None on CPU ranks): what to set
    against the planner's estimate (``components.dlrm:plan``)."""
    if env.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(env.device)], dtype=torch.int64, device=env.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _fmt_metrics(values: dict[str, float]) -> str:
    return "  ".join(f"{name} {value:.4f}" for name, value in sorted(values.items()))


@record  # a failing rank's traceback goes to torchrun's error file, which TorchX reports
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_config(argv)
    env = init_distributed()
    setup_logging(env.rank)
    try:
        train(cfg, env)
    except ConfigError as e:
        if env.is_main:
            logger.error("%s", e)
        sys.exit(2)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
