"""The owner of a training run: :class:`Trainer`.

The recipe: build the model on the meta device, fuse the embedding optimizer into backward,
plan and shard the tables across ranks, then step TorchRec's training pipeline, validate and
test with metrics synced across ranks, checkpoint on the way, and write summary.json.
"""

import contextlib
from typing import Any, Generator, Generic, Iterator

import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineSparseDist, train_pipelines

from apps.core.checkpoint.checkpointer import Checkpointed, Checkpointer, TrainState, open_checkpoints
from apps.core.checkpoint.folder import Checkpoint
from apps.core.common.distributed import DistEnv
from apps.core.common.errors import ConfigError
from apps.core.config import LaunchConfig, with_device_defaults
from apps.core.options import option_values
from apps.core.training.app import C, EvalMetrics, TrainingApp
from apps.core.training.device_support import check_device_support
from apps.core.training.lean import LeanPipeline, call_tables_directly, lean_step_refusal, step_kind
from apps.core.training.metrics import Throughput
from apps.core.training.optim import LRSchedule, LRShape, training_optimizer
from apps.core.training.precision import set_tf32
from apps.core.training.report import PLAN_FILE, Reporter
from apps.core.training.run_folder import open_output_dir, point_latest_at, results_of
from apps.core.training.run_length import RunLength
from apps.core.training.sharding import (
    build_plan,
    describe_plan,
    model_to_shard,
    plan_tables,
    shard_model,
    summarize_plan,
)
from apps.core.training.step_graph import GraphedLeanPipeline, graph_kind, lr_holds_for, step_graph_refusal
from apps.core.training.train_log import TrainingDiverged, TrainingLog
from apps.core.training.validations import Validations
from apps.core.urls import config_record, redact_urls

#: --pipeline -> TorchRec's class of that name (torchrec.distributed.train_pipeline).
PIPELINE_CLASSES = {
    "sparse_dist": "TrainPipelineSparseDist",
    "base": "TrainPipelineBase",
    "semi_sync": "TrainPipelineSemiSync",
    "fused_sparse_dist": "TrainPipelineFusedSparseDist",
    "sparse_dist_lite": "TrainPipelineSparseDistLite",
    "prefetch": "PrefetchTrainPipelineSparseDist",
}


def pipeline_class(cfg: LaunchConfig) -> type[TrainPipeline]:
    """TorchRec's pipeline class that --pipeline names, if this TorchRec has it."""
    name = PIPELINE_CLASSES[cfg.pipeline]
    cls = getattr(train_pipelines, name, None)
    if cls is None:
        raise ConfigError(
            f"--pipeline {cfg.pipeline} needs TorchRec's {name}, which torchrec "
            f"{torchrec.__version__} does not have: upgrade torchrec or use --pipeline sparse_dist"
        )
    return cls


class Trainer(Generic[C]):
    """One training run of an app, built once (collective) from the app, its config and the
    process group: it owns the data, the sharded model, its optimizers and learning-rate
    schedule, TorchRec's pipeline, the checkpointer, the reporter and where the run is
    (:class:`TrainState`).

    ``fit()`` resumes, trains, validates and tests, and writes summary.json; ``evaluate()``
    measures a split; ``close()`` must follow (it waits for a checkpoint still being written).
    """

    def __init__(self, app: TrainingApp[C], cfg: C, env: DistEnv) -> None:
        cfg, device_defaults = with_device_defaults(cfg, env.device.type)  # what the run trains with
        check_device_support(cfg, env.device.type)
        self.app, self.cfg, self.env = app, cfg, env
        folder = open_checkpoints(cfg, env)  # before the model: a bad --checkpoint_dir fails in seconds
        self.run_id = folder.run_id
        # So does an --output_dir of another run; a resumed run may write into its own.
        output_dir = open_output_dir(
            cfg.evaluation.output_dir,
            self.run_id,
            folder.resume_from is not None,
            env,
            app.name,
            cfg.checkpoint.checkpoint_dir,
        )
        self.reporter = Reporter(output_dir, enabled=env.is_main)
        if device_defaults:
            self.reporter.log("%s", device_defaults)
        pipeline_cls = pipeline_class(cfg.launch)
        self.data = app.make_data(cfg, env, folder.resume_from)  # so does a bad --data_path
        self.run_length = RunLength.of(cfg, self.data.steps_per_epoch)
        if env.device.type == "cuda":
            set_tf32(cfg.launch.allow_tf32)
        # Same seed on every rank: DDP needs identical dense weights to start from.
        torch.manual_seed(cfg.training.seed)
        model, sharders = model_to_shard(app, cfg, dense_device=env.device)
        self.plan = build_plan(app, cfg, model, sharders, env)
        sharding_types = [table["type"] for table in plan_tables(self.plan).values()]
        #: Why the step is TorchRec's sharded one; empty: the lean step (apps/core/training/lean.py).
        self.not_lean = lean_step_refusal(cfg.launch, app.tables, sharding_types, env.world_size)
        self.model = shard_model(model, self.plan, sharders, env, data_parallel=bool(self.not_lean))
        if not self.not_lean:
            call_tables_directly(self.model.module, app.tables)
            pipeline_cls = LeanPipeline
        self.optimizer = training_optimizer(cfg.training, self.model, app.tables)
        lr_shape = LRShape.of(cfg.training, self.run_length.steps)
        self.schedule = LRSchedule(lr_shape, self.optimizer)
        kernels = [table["kernel"] for table in plan_tables(self.plan).values()]
        #: Why the step is not one CUDA graph; empty: it is (apps/core/training/step_graph.py).
        self.not_graph = step_graph_refusal(cfg.launch, cfg.training, env.device.type, self.not_lean, kernels)
        if not self.not_graph:
            self.pipeline: TrainPipeline = GraphedLeanPipeline(
                self.model,
                self.optimizer,
                env.device,
                lrs_hold=lambda: lr_holds_for(lr_shape, self.state.step),
                log=lambda line: self.reporter.log("%s", line),
            )
        else:
            self.pipeline = pipeline_cls(self.model, self.optimizer, env.device)
        self.checkpointer = Checkpointer(cfg, env, folder, self.checkpointed, self.run_length.steps)
        self.validations = Validations.of(cfg.evaluation, self.run_length)
        self.state = TrainState(env.rank, validations=self.validations)  # checkpoints keep them

    @property
    def checkpointed(self) -> Checkpointed:
        """What this run's checkpoints hold."""
        return Checkpointed(self.model, self.optimizer, plan_tables(self.plan), self.app.tables, self.data.columns)

    def fit(self) -> dict[str, Any]:
        """The whole run: resume or start, train (validating on the way, stopping early if the
        validations say so), test, and write summary.json; returns the summary (empty when a
        resumed run had nothing left to train: then nothing is written)."""
        cfg, env, run = self.cfg, self.env, self.run_length
        if cfg.evaluation.evaluate_checkpoint:
            return self.evaluate_checkpoint(cfg.evaluation.evaluate_checkpoint)
        resumed = self.restore()
        if self.state.step >= run.steps or self.validations.stopped_early:
            assert resumed is not None  # a fresh run has steps to train: RunLength has at least one
            results = results_of(self.reporter.output_dir, self.run_id) if env.is_main else None
            self.reporter.log(
                "nothing left to do: %s already trained %d of %d steps%s; its results stay as they are%s",
                resumed.url,
                self.state.step,
                run.steps,
                " and stopped early" if self.validations.stopped_early else "",
                f": {results}" if results else "",
            )
            return {}
        self._start_results()
        global_batch = cfg.training.batch_size * env.world_size
        self.reporter.log(
            "training steps %d..%d: %s; %d ranks on %s (%s)",
            self.state.step + 1,
            run.steps,
            run.describe(global_batch),
            env.world_size,
            env.device.type,
            env.backend,
        )
        self.reporter.log("training step: %s", step_kind(self.not_lean, type(self.pipeline).__name__))
        if not self.not_lean:
            self.reporter.log("lean step: %s", graph_kind(self.not_graph))
        throughput = self._train()
        tested = self._load_best()
        test = self.evaluate("test", cfg.evaluation.test_batches)
        self.reporter.scalars("test", test, tested)
        self.reporter.record("test", tested, test)
        which = "the best validation's model" if tested != self.state.step else "the model"
        self.reporter.log("test (%s, after step %d): %s", which, tested, _fmt_metrics(test))
        self.checkpointer.wait()
        summary = self._summary(test, tested, resumed, throughput)
        if self.reporter.write_summary(summary):
            self.reporter.draw_curves(self.app.curves)
            self.reporter.log_results()
        self.reporter.close()
        return summary

    def _start_results(self) -> None:
        """The run starts training or evaluating: its folder becomes the newest run's (``latest``)
        and gets its plan. Not sooner: a run that fails at start-up (its data, its checkpoint) or
        has nothing left to do leaves ``latest`` at the last run with results."""
        if self.env.is_main:
            point_latest_at(self.cfg.evaluation.output_dir, self.reporter.output_dir)
        if self.reporter.output_dir:
            self.reporter.log("run %s writes its results to %s", self.run_id, self.reporter.output_dir)
        self._log_plan()

    def _log_plan(self) -> None:
        """The sharding plan in one line, and the whole of it (a line per table) in the run's
        plan.txt; in the log where the run has no folder."""
        kind, whole = self.cfg.launch.sharding_type, describe_plan(self.plan)
        brief = summarize_plan(self.plan, self.env.world_size)
        path = self.reporter.write_file(PLAN_FILE, whole + "\n")
        if path:
            self.reporter.log("sharding plan (%s): %s; the whole plan: %s", kind, brief, path)
        else:
            self.reporter.log("sharding plan (%s): %s:\n%s", kind, brief, whole)

    def restore(self) -> Checkpoint | None:
        """Collective. Resumes from the newest committed checkpoint of --checkpoint_dir, if any,
        with its validations (the best so far, the count towards early stopping)."""
        resumed = self.checkpointer.restore(self.state)
        if resumed is not None:
            self._forget_graphs()
            self.reporter.log("resumed from %s (step %d)", resumed.url, self.state.step)
            changed = changed_data_options(resumed.manifest.get("config", {}), self.cfg)
            if changed:
                self.reporter.log(
                    "%s was written by a run that read other data: %s; this run goes on from its step %d with "
                    "this command's (to train on these data from the start, give a new --checkpoint_dir)",
                    resumed.url,
                    "; ".join(changed),
                    self.state.step,
                )
        return resumed

    def train_step(self, batches: Iterator[Any]) -> torch.Tensor:
        """Trains on the next batch at the scheduled learning rate; returns its loss (on the device)."""
        self.schedule.apply(self.state.step)
        loss = self.pipeline.progress(batches)[0]  # the outputs start with the detached loss
        self.state.step += 1
        return loss

    def evaluate(self, split: str, num_batches: int) -> dict[str, float]:
        """The app's metrics on ``split`` over all ranks (with their ceiling where the data has
        one); the pipeline's batches in flight wait meanwhile."""
        metrics = self.app.eval_metrics(self.cfg, self.data, split, self.env.device)
        with self._pipeline_paused() as model:
            return evaluate(self.app, self.cfg, model, self.data.eval_batches(split, num_batches), self.env, metrics)

    def close(self) -> None:
        """Waits for the last save, still being written, to commit: before the process group goes."""
        self.checkpointer.close()

    def record_failure(self, error: Exception, **details: Any) -> None:
        """Writes summary.json of a run that ``error`` ended after it started: why, how far it got,
        and ``details`` (such as the step that failed)."""
        summary = {
            "failed": str(error),
            "steps": self.state.step,
            **details,
            "run_id": self.run_id,
            "config": config_record(self.cfg),
        }
        path = self.reporter.write_summary(summary)
        if path:
            self.reporter.log("wrote %s, with the failure", path)
        self.reporter.close()

    def _train(self) -> Throughput:
        """Trains from ``state.step`` to the run's last step, or until early stopping, handing
        each step to those who decide what it is for: the log, the validations, the
        checkpointer. Returns the run's throughput."""
        cfg, env, state, run = self.cfg, self.env, self.state, self.run_length
        global_batch = cfg.training.batch_size * env.world_size
        log = TrainingLog(self.reporter, env, state, cfg.evaluation.log_every, run.steps, global_batch)
        # Closed when training ends or fails: a data loader's threads must not outlive it.
        with contextlib.closing(self.data.train_batches(start_step=state.step)) as batches:
            while state.step < run.steps and not self.validations.stopped_early:
                loss = self.train_step(batches)
                self._hand_over(state.step, loss, log)
            log.end()
        return log.throughput

    def _hand_over(self, step: int, loss: torch.Tensor, log: TrainingLog) -> None:
        """Collective. What follows training ``step`` (with ``loss``, on the device): its log line
        (a step the checkpointer saves on its schedule is logged, its loss guarded), its validation
        and its checkpoint, each where its owner says it is due."""
        validates = self.validations.due(step)
        try:
            log.step(loss, saved=self.checkpointer.due(step), validated=validates)
        except TrainingDiverged as error:
            self.reporter.close_progress()
            self.record_failure(error, failed_step=error.step)
            raise
        if validates:
            self._validate(step)
        # The best validation's model is kept (--checkpoint_dir) to be tested at the end.
        url = self.checkpointer.save_if_due(self.state, keep=self.validations.keeps(step))
        if url is not None:
            stall = self.checkpointer.stalls[-1]
            self.reporter.log("step %d: checkpoint taken for %s (training stopped %.2f s)", step, url, stall)
        log.pause()  # validation and checkpoint time is not training time

    def evaluate_checkpoint(self, which: str) -> dict[str, Any]:
        """Evaluation only: loads the checkpoint ``which`` names (best, latest, a step) into this
        run's sharded model (resharded as a resume is), measures the validation and test splits,
        and writes them to summary.json; trains nothing and saves nothing."""
        checkpoint = self.checkpointer.named(which)
        self.load(checkpoint)
        self._start_results()
        self.reporter.log("evaluating %s (step %d), trained nothing", checkpoint.url, checkpoint.step)
        val = self.evaluate("val", self.cfg.evaluation.val_batches)
        test = self.evaluate("test", self.cfg.evaluation.test_batches)
        self.reporter.log("validation: %s", _fmt_metrics(val))
        self.reporter.log("test: %s", _fmt_metrics(test))
        summary = {
            "evaluated_checkpoint": redact_urls(checkpoint.url),
            "evaluated_step": checkpoint.step,
            **{f"val_{name}": value for name, value in val.items()},
            **{f"test_{name}": value for name, value in test.items()},
            "world_size": self.env.world_size,
            "config": config_record(self.cfg),
        }
        path = self.reporter.write_summary(summary)
        if path:
            self.reporter.log("wrote %s", path)
        self.reporter.close()
        return summary

    def load(self, checkpoint: Checkpoint) -> None:
        """Collective. Loads the model of ``checkpoint`` (not the run's state: nothing resumes)
        and has the data feed it the columns it trained on, by name: the data source is made
        again where the checkpoint records its columns otherwise than the data source read them
        (the same columns listed in another order, which fed by place would score garbage)."""
        trained = checkpoint.manifest.get("columns")
        if trained is not None and trained != self.data.columns:
            self.data = self.app.make_data(self.cfg, self.env, checkpoint)
            self.checkpointer.checkpointed = self.checkpointed
        self.checkpointer.restore(TrainState(self.env.rank), checkpoint)
        self._forget_graphs()

    def _forget_graphs(self) -> None:
        """The model's and optimizers' state was loaded: CUDA graphs captured before read
        tensors that loading replaced, and are captured again."""
        if isinstance(self.pipeline, GraphedLeanPipeline):
            self.pipeline.forget()

    def _load_best(self) -> int:
        """Collective. Loads the checkpoint of the best validation, if the run kept one and has
        trained past it; returns the step whose model is now in place."""
        best = self.validations.best_step
        if best is None or best == self.state.step or self.checkpointer.store is None:
            return self.state.step
        checkpoint = self.checkpointer.committed(best)
        self.load(checkpoint)
        self.reporter.log("loaded the best validation's checkpoint %s (step %d) to test it", checkpoint.url, best)
        return best

    def _validate(self, step: int) -> None:
        """Validates after ``step``; reports it and takes it into the run's validations."""
        reporter, validations = self.reporter, self.validations
        val = self.evaluate("val", self.cfg.evaluation.val_batches)
        validations.add(step, val)
        reporter.scalars("val", val, step)
        reporter.record("val", step, val)
        reporter.log("step %d validation: %s  (%s)", step, _fmt_metrics(val), validations.verdict(step))
        for name, note in self.app.notes.items():
            if name in val:
                reporter.note(note)
        if validations.stopped_early:
            reporter.log("%s", validations.stopping(step))

    @contextlib.contextmanager
    def _pipeline_paused(self) -> Iterator[nn.Module]:
        """The plain model, while the pipeline's in-flight batches wait: a sparse-dist pipeline
        swaps the model's forward for its own and must give it back first. Under the step
        graph, the model's forward-only graph (``GraphedLeanPipeline.forward_graph``)."""
        if isinstance(self.pipeline, TrainPipelineSparseDist):
            yield self.pipeline.detach()
            # The batch in flight started its input all-to-all before the pause: attaching must not
            # start it again (TorchRec's default), which broke the next step's all-to-all of an
            # EmbeddingCollection on sequence batches (gloo: in->size == out->size).
            self.pipeline.attach(sparse_dist=False)
        elif isinstance(self.pipeline, GraphedLeanPipeline):
            yield self.pipeline.forward_graph
        else:
            yield self.model

    def _summary(
        self, test: dict[str, float], tested: int, resumed: Checkpoint | None, throughput: Throughput
    ) -> dict[str, Any]:
        """summary.json: the last validation, the test of the model after step ``tested``, the run."""
        cfg, env, validations = self.cfg, self.env, self.validations
        return {
            **self.app.summary(validations.latest, test, validations.best or {}),
            "final_train_loss": self.state.train_loss,
            "epochs": self.run_length.epochs(self.state.step),
            "stopped_early": self.validations.stopped_early,
            "best_step": self.validations.best_step,
            "test_step": tested,
            "resumed_from_step": resumed.step if resumed else None,
            "samples_per_sec": throughput.samples_per_sec,
            "train_seconds": throughput.seconds,
            "steps": self.state.step,
            "world_size": env.world_size,
            "global_batch_size": cfg.training.batch_size * env.world_size,
            "device": env.device.type,
            "backend": env.backend,
            "peak_hbm_bytes": peak_hbm_bytes(env),
            "checkpoint_stall_seconds": self.checkpointer.stalls,
            "checkpoint_wait_seconds": self.checkpointer.waits,
            "sharding_plan": describe_plan(self.plan).splitlines(),
            "run_id": self.run_id,
            "config": config_record(cfg),
        }


def evaluate(
    app: TrainingApp[C],
    cfg: C,
    model: nn.Module,
    batches: Generator[Any, None, None],
    env: DistEnv,
    metrics: EvalMetrics,
) -> dict[str, float]:
    """``metrics`` of ``model`` over this rank's ``batches`` (what ``app`` takes of each), gathered over all ranks."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), contextlib.closing(batches):
        for batch in batches:
            metrics.update(batch, app.eval_outputs(cfg, model, batch.to(env.device)))
    model.train(was_training)
    return metrics.compute()


def peak_hbm_bytes(env: DistEnv) -> int | None:
    """The most GPU memory any rank's tensors took at once (None on CPU ranks): what to set
    against the planner's estimate (``components.dlrm:plan``)."""
    if env.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(env.device)], dtype=torch.int64, device=env.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def changed_data_options(saved: dict[str, Any], cfg: Any) -> list[str]:
    """The options of what a run reads (its data section, the batch size) whose values differ
    from ``saved``, a checkpoint's record of its run's options, as ``--name old (now new)``.
    Resuming with them is allowed (a run may go on with more data, or on more ranks) but must
    not pass unnoticed: a finished run resumed on new data trains nothing on them."""
    now = config_record(cfg)
    names = [*option_values(cfg.data), "batch_size"]
    return [
        f"--{name} {saved[name]} (now {now[name]})"
        for name in names
        if name in saved and _differ(saved[name], now[name])
    ]


def _differ(saved: Any, now: Any) -> bool:
    if isinstance(saved, str) and isinstance(now, str):  # a folder with or without its last "/"
        return saved.rstrip("/") != now.rstrip("/")
    return saved != now


def _fmt_metrics(values: dict[str, float]) -> str:
    return "  ".join(f"{name} {value:.4f}" for name, value in sorted(values.items()))
