"""The sections of a training run's configuration that every app shares: how long and how it
learns (:class:`TrainingConfig`), how it runs on its ranks and devices (:class:`LaunchConfig`),
validation, test and results (:class:`EvaluationConfig`) and checkpoints (:class:`CheckpointConfig`).

An app's ``JobConfig`` (``apps.dlrm.config``) composes them with its own model and data
sections; each section's ``check()`` refuses a bad value in one line. The option names are
global (the command line is flat), so an app's own sections must not reuse these names.
"""

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Protocol, TypeVar

from apps.core.common.errors import ConfigError
from apps.core.options import C, check_choices, field_default, option, parse_config

SHARDING_TYPES = (
    "auto",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "data_parallel",
)
ROW_WISE_KINDS = ("row_wise", "table_row_wise")
COMM_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "adam")
DENSE_OPTIMIZERS = ("adagrad", "sgd", "adam")
DENSE_PRECISIONS = ("fp32", "bf16")
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "reduce-overhead")
LEAN_STEPS = ("auto", "false")
STEP_GRAPHS = ("auto", "false")
PIPELINES = ("sparse_dist", "base", "semi_sync", "fused_sparse_dist", "sparse_dist_lite", "prefetch")
#: Training steps of synthetic data when --steps is not given: it never repeats, so has no epochs.
SYNTHETIC_STEPS = 1500
#: In --output_dir, the name of a new folder per run (apps/core/training/run_folder.py).
RUN_PLACEHOLDER = "{run}"


#: The most training samples per rank per step: a batch's ids are counted in int32 by TorchRec's
#: KeyedJaggedTensor offsets, and 2^24 samples leave room for 128 ids each.
MAX_BATCH_SIZE = 2**24
#: The largest seed: torch holds seeds in 64 bits, and the Parquet and Criteo shuffles in int64.
SEED_MAX = 2**63 - 1


@dataclass(slots=True)
class TrainingConfig:
    """How long and how the model learns: batches, steps, optimizers, learning rates, seed."""

    #: The run's length on synthetic data (which has no epochs) when --steps is 0: an app whose
    #: step costs more sets its own, so that its default run takes minutes, as the DLRM's does.
    synthetic_steps: ClassVar[int] = SYNTHETIC_STEPS
    #: The batch per rank of a run whose ranks have GPUs, unless it gives --batch_size (or its
    #: --preset sets it); None: the CPU's. The DLRM's: 512 samples keep an H200 mostly waiting
    #: (40-42 k samples/s, slower than two CPU cores), a cost per step that a 32 times larger
    #: batch shares among 32 times the samples. Its learning rates stay: at this batch they reach
    #: within 0.05 of the synthetic ceiling in 200 of the default run's 1500 steps, and 4 times
    #: larger ones did worse (measured on CPU: docs/training.md, "On GPUs").
    gpu_batch_size: ClassVar[int | None] = 16384

    seed: int = option(
        0, "Seed of the model initialisation, of the synthetic data and of the shuffling of files' rows."
    )
    batch_size: int = option(
        512,
        "Training samples per rank per step. Not given (nor set by --preset), a run on GPUs takes "
        f"{gpu_batch_size} per GPU and says so (the components cannot tell 512 given from not given).",
    )
    steps: int = option(
        0,
        "Training steps (batches per rank), at most. 0: --epochs of finite data (files), "
        f"{SYNTHETIC_STEPS} steps of synthetic data (which never repeats, so has no epochs).",
    )
    epochs: int = option(
        1,
        "Passes over the training rows of finite data (files), as TorchRec's examples count them; "
        "--steps, when given, stops earlier. The log says at start how many steps an epoch is.",
    )
    learning_rate: float = option(0.05, "Learning rate of the embedding tables.")
    dense_learning_rate: float = option(0.01, "Learning rate of the dense MLPs; 0 uses --learning_rate.")
    lr_warmup_steps: int = option(0, "Steps over which the learning rates ramp up linearly from 0; 0: no warmup.")
    lr_decay_start: int = option(0, "Step at which the learning rates start to decay (with --lr_decay_steps > 0).")
    lr_warmup_fraction: float = option(
        0.0, "Warmup over this fraction of the run's steps (e.g. 0.05), instead of --lr_warmup_steps."
    )
    lr_decay_fraction: float = option(
        0.0,
        "Polynomial (power 2) decay over this last fraction of the run's steps (e.g. 0.2), instead of "
        "--lr_decay_start and --lr_decay_steps.",
    )
    lr_decay_steps: int = option(
        0,
        "Steps of polynomial (power 2) decay of the learning rates, as in MLPerf's recommendation "
        "benchmark (--lr_warmup_steps 2750 --lr_decay_start 49315 --lr_decay_steps 27772); 0: no decay.",
    )
    embedding_optimizer: str = option(
        "rowwise_adagrad",
        "Optimizer of the embedding tables, fused into the backward pass (adam: GPU only).",
        choices=EMBEDDING_OPTIMIZERS,
    )
    dense_optimizer: str = option("adagrad", "Optimizer of the dense MLPs.", choices=DENSE_OPTIMIZERS)

    def check(self) -> None:
        require_positive("batch_size", self.batch_size)
        if self.batch_size > MAX_BATCH_SIZE:
            raise ConfigError(
                f"--batch_size {self.batch_size} is more than {MAX_BATCH_SIZE} samples per rank per step: "
                "TorchRec counts a batch's ids in int32; give a smaller --batch_size (it is per rank: "
                "more ranks make a larger global batch)"
            )
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(
                f"--seed {self.seed} must be in [0, 2^63 - 1]: numpy's generators refuse negative seeds "
                "and torch's hold them in 64 bits; give a seed such as 0 or 1234"
            )
        require_positive("epochs", self.epochs)
        for name in ("steps", "lr_warmup_steps", "lr_decay_start", "lr_decay_steps"):
            require_not_negative(name, getattr(self, name))
        for name, steps in (("lr_warmup_fraction", "lr_warmup_steps"), ("lr_decay_fraction", "lr_decay_steps")):
            fraction = getattr(self, name)
            if not 0 <= fraction < 1:
                raise ConfigError(f"--{name} {fraction} must be in [0, 1): a fraction of the run's steps")
            if fraction and getattr(self, steps):
                raise ConfigError(f"--{name} and --{steps} both shape the learning rate: give one of them")
        if self.lr_decay_fraction and self.lr_decay_start:
            raise ConfigError("--lr_decay_fraction and --lr_decay_start both place the decay: give one of them")
        if self.lr_warmup_fraction + self.lr_decay_fraction > 1:
            raise ConfigError(
                f"--lr_warmup_fraction {self.lr_warmup_fraction} and --lr_decay_fraction "
                f"{self.lr_decay_fraction} add up to more than the run: their sum must be at most 1"
            )
        require_positive("learning_rate", self.learning_rate)
        if self.dense_learning_rate < 0:
            raise ConfigError(
                f"--dense_learning_rate {self.dense_learning_rate} must be positive (or 0 to use --learning_rate)"
            )
        if self.lr_decay_steps and self.lr_decay_start < self.lr_warmup_steps:
            raise ConfigError(
                f"--lr_decay_start {self.lr_decay_start} is inside the warmup "
                f"(--lr_warmup_steps {self.lr_warmup_steps}): warmup must finish before decay starts"
            )

    @property
    def dense_lr(self) -> float:
        return self.dense_learning_rate or self.learning_rate


@dataclass(slots=True)
class LaunchConfig:
    """How the run is laid out on its ranks and devices: sharding, comms, pipeline, precision."""

    pipeline: str = option(
        "sparse_dist",
        "Training loop, one of TorchRec's train pipelines: sparse_dist (TrainPipelineSparseDist: "
        "the next batch's copy and input all-to-all overlap this batch's compute), base (a plain "
        "loop, TrainPipelineBase), sparse_dist_lite (TrainPipelineSparseDistLite: fewer streams "
        "and events per step), and on GPUs only: semi_sync (TrainPipelineSemiSync: after 900 "
        "batches the embedding lookup also overlaps, one step stale), fused_sparse_dist "
        "(TrainPipelineFusedSparseDist: the lookup runs on the input all-to-all's stream) or "
        "prefetch (PrefetchTrainPipelineSparseDist: also prefetches UVM-cached rows).",
        choices=PIPELINES,
    )
    lean_step: str = option(
        "auto",
        "auto: on one rank, with every table table_wise or data_parallel and --pipeline "
        "sparse_dist, sparse_dist_lite or base, call the tables' FBGEMM kernels directly, without "
        "TorchRec's all-to-alls, DDP or pipeline rewrite (the same kernels, fused optimizer, "
        "losses and checkpoints, less host time per step); false: TorchRec's sharded step always. "
        "The log says which step runs.",
        choices=LEAN_STEPS,
    )
    step_graph: str = option(
        "auto",
        "auto: on a GPU, where the lean step runs and every batch has the same shapes (features "
        "of fixed sizes), capture the whole training step (forward, backward with "
        "the fused table update, dense optimizer step) in one CUDA graph and replay it, captured "
        "again when the learning rate changes (eager while it changes every step); validation "
        "and test replay a forward-only graph. false: eager steps. Does nothing on CPUs; the log "
        "says which step runs.",
        choices=STEP_GRAPHS,
    )
    sharding_type: str = option(
        "auto",
        "How embedding tables are split across ranks; auto lets TorchRec's planner choose.",
        choices=SHARDING_TYPES,
    )
    qcomm_forward_precision: str = option(
        "fp32",
        "Precision of the embedding all-to-all in the forward pass (fp8: GPU only).",
        choices=COMM_PRECISIONS,
    )
    qcomm_backward_precision: str = option(
        "fp32",
        "Precision of the embedding gradient all-to-all in the backward pass (fp8: GPU only).",
        choices=COMM_PRECISIONS,
    )
    allow_tf32: bool = option(True, "On GPUs, let float32 matmuls use TF32 tensor cores (faster, ~1e-3 precision).")
    dense_precision: str = option(
        "fp32",
        "Precision of the dense part's compute (bottom MLP, interaction, top MLP). bf16: under "
        "bf16 autocast, its weights and optimizer state staying fp32; the tables, their fused "
        "optimizer and all-to-all are not affected (see --qcomm_*_precision).",
        choices=DENSE_PRECISIONS,
    )
    compile_dense: str = option(
        "none",
        "torch.compile the dense part (bottom MLP, interaction, top MLP) in this mode: fewer, "
        "fused kernels. reduce-overhead also replays them as CUDA graphs (GPU only). The first "
        "steps take longer while it compiles; parameter names, hence checkpoints, do not change.",
        choices=COMPILE_MODES,
    )
    hbm_gb: float = option(
        0.0,
        "GPU memory per rank, in GiB, that TorchRec's planner places tables in. 0: the GPU's "
        "own (training), or the GPU of the instance type of -h (plan preview, --check_plan). "
        "Less than the GPU has makes the planner keep the tables that do not fit in host memory, "
        "cached in HBM (fused_uvm_caching).",
    )

    def check(self) -> None:
        if self.hbm_gb < 0:
            raise ConfigError(f"--hbm_gb {self.hbm_gb} must be 0 or more (0: the GPU's own memory)")
        if self.sharding_type in ROW_WISE_KINDS:
            check_int8_comms(self, [self.sharding_type])


@dataclass(slots=True)
class EvaluationConfig:
    """Validation, test, logging and where the results go; an app subclasses it to name its own
    metrics as --early_stopping_metric's choices."""

    val_every_steps: int = option(
        0,
        "Validate every N training steps (and at the end); 0: after every epoch of finite data and "
        "at the end (synthetic data: at the end only).",
    )
    val_batches: int = option(
        40,
        "Validation batches per rank; 0: the whole split (of files; synthetic splits have no end, "
        "so it is refused there).",
    )
    test_batches: int = option(
        40,
        "Test batches per rank, run once after training; 0: the whole split (of files; synthetic "
        "splits have no end, so it is refused there).",
    )
    early_stopping_patience: int = option(
        0,
        "Stop training after this many validations in a row without an improvement of at least "
        "--early_stopping_min_delta in --early_stopping_metric; 0: never stop early.",
    )
    early_stopping_min_delta: float = option(
        0.0, "The smallest change of --early_stopping_metric that counts as an improvement."
    )
    #: Each app's own section overrides this field with its metrics as the choices and its default
    #: (an overridden field keeps its place among the options): apps/dlrm/config.py's.
    early_stopping_metric: str = option(
        "", "The validation metric that early stopping and the best step follow: one of the app's metrics."
    )
    evaluate_checkpoint: str = option(
        "",
        "Evaluate a checkpoint of --checkpoint_dir instead of training: best (the BEST marker's), "
        "latest, or a step number; on the validation and test splits of --data, which may be other "
        "data than it was trained on, with the same model options, on any -j. Empty: train.",
    )
    log_every: int = option(100, "Log the training loss and throughput every N steps.")
    output_dir: str = option(
        f"outputs/{RUN_PLACEHOLDER}",
        f"Directory that receives summary.json and TensorBoard event files, a new one per run where "
        f"its name is {RUN_PLACEHOLDER} (the TorchX app id, or the job's name and start time), with "
        f"a link 'latest' beside it; a folder holding another run's results is refused. Empty: none.",
    )

    def check(self) -> None:
        require_positive("log_every", self.log_every)
        for name in ("val_every_steps", "val_batches", "test_batches", "early_stopping_patience"):
            require_not_negative(name, getattr(self, name))
        require_not_negative("early_stopping_min_delta", self.early_stopping_min_delta)
        which = self.evaluate_checkpoint
        if which and which not in ("best", "latest") and not which.isdigit():
            raise ConfigError(f"--evaluate_checkpoint {which!r}: give best, latest or a step number (e.g. 1500)")
        parent, _, name = self.output_dir.rstrip("/").rpartition("/")
        if RUN_PLACEHOLDER in parent or (RUN_PLACEHOLDER in name and name != RUN_PLACEHOLDER):
            raise ConfigError(
                f"--output_dir {self.output_dir!r}: {RUN_PLACEHOLDER} stands for the whole name of the "
                f"last folder only, e.g. --output_dir outputs/{RUN_PLACEHOLDER}"
            )


@dataclass(slots=True)
class CheckpointConfig:
    """Where and how often the run checkpoints, and how many it keeps."""

    checkpoint_dir: str = option(
        "",
        "Where checkpoints go: a directory or fsspec URL (file://, s3://, gs://; memory:// "
        "for one process). A run resumes from the newest committed checkpoint there, without "
        "any other flag. Empty: no checkpoints.",
    )
    checkpoint_every: int = option(
        500, "Save a checkpoint every N steps (and always after the last); 0: only after the last."
    )
    keep_last: int = option(2, "Committed checkpoints to keep; older ones are deleted.")
    checkpoint_async: bool = option(
        True,
        "Save checkpoints in the background: training stops only while the state is copied to "
        "host memory (pinned on GPUs), then goes on while it is written; a checkpoint counts "
        "only once every rank's part is written. false: training waits for every save.",
    )

    def check(self) -> None:
        require_positive("keep_last", self.keep_last)
        require_not_negative("checkpoint_every", self.checkpoint_every)


def check_int8_comms(cfg: LaunchConfig, sharding_types: list[str]) -> None:
    """int8 comms need all-to-all: TorchRec's int8 codec fails in row-wise reduce-scatters."""
    row_wise = sorted(set(sharding_types) & set(ROW_WISE_KINDS))
    for name in ("qcomm_forward_precision", "qcomm_backward_precision"):
        if getattr(cfg, name) == "int8" and row_wise:
            raise ConfigError(
                f"--{name} int8 does not work with {'/'.join(row_wise)} sharding: TorchRec's "
                "int8 codec has no quantization context in the reduce-scatter those tables use; "
                "use fp16 or bf16, or a table_wise/column_wise sharding"
            )


R = TypeVar("R", bound="SharedSections")


class SharedSections(Protocol):
    """What the shared training machinery reads of an app's ``JobConfig``: the shared sections
    (the app's model and data sections are the app's own business)."""

    #: The options given, or set by a --preset (apps/core/options.py, ``Options.explicit``).
    @property
    def explicit(self) -> frozenset[str]: ...

    def replace(self: R, **changes: Any) -> R:
        """A copy with the options (flat names) in ``changes`` changed, validated anew."""
        ...

    # Read-only here, so that an app's config may hold a subclass of a section (its own metrics).
    @property
    def training(self) -> TrainingConfig: ...
    @property
    def launch(self) -> LaunchConfig: ...
    @property
    def evaluation(self) -> EvaluationConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...

    def app_gpu_only_options(self) -> Iterator[str]:
        """The app's own options that ranks without GPUs cannot run, each as its one-line refusal
        (the shared ones are :mod:`apps.core.training.device_support`'s)."""
        ...

    def model_signature(self) -> dict[str, Any]:
        """The options that fix the shapes of a checkpoint's tensors (the model's and the
        optimizers' states): a checkpoint's manifest records them, and a run whose differ is
        refused its checkpoints."""
        ...


class CheckedJob(SharedSections, Protocol):
    """What :func:`check_job` asks of an app's ``JobConfig`` besides the shared sections."""

    @property
    def synthetic(self) -> bool:
        """Whether the run trains on synthetic data, which never ends: no epochs, no whole splits."""
        ...

    def check_own_sections(self) -> None:
        """Refuses a bad value of the app's own sections (its model and data), in the order the
        app's checks need (one may complete a section for the next)."""
        ...

    def check_with_shared(self) -> None:
        """Refuses the app's options that do not go with the shared sections' (checked by then)."""
        ...


def check_job(cfg: CheckedJob) -> None:
    """Every app's ``JobConfig`` checks itself in this order (its ``__post_init__``), so that a
    configuration wrong in several ways is refused for the same one in every app: the choices,
    the app's own sections, what the data's length allows (:func:`check_run_length`), the shared
    sections one by one, the app's options against the shared ones, and last what evaluating a
    checkpoint needs."""
    check_choices(cfg)
    cfg.check_own_sections()
    check_run_length(cfg.training, cfg.evaluation, synthetic=cfg.synthetic)
    for shared in (cfg.training, cfg.launch, cfg.evaluation, cfg.checkpoint):
        shared.check()
    cfg.check_with_shared()
    check_evaluation_only(cfg.evaluation, cfg.checkpoint)


def parse_train_command(cls: type[C], app: str, trains: str, argv: list[str] | None) -> C:
    """``python -m apps.<app>.train``'s command line ``argv`` as a validated ``cls`` (the app's
    ``JobConfig``); its help says that the command trains ``trains`` (``"a sharded DLRM"``).
    A bad value exits 2, naming it."""
    return parse_config(
        cls,
        argv,
        prog=f"python -m apps.{app}.train",
        description=f"Train, validate and test {trains} with TorchRec. Run it under torchrun (or "
        f"`torchx run components.{app}:train`); alone it trains on one process.",
    )


def with_device_defaults(cfg: R, device_type: str) -> tuple[R, str]:
    """``cfg`` as a run whose ranks are on ``device_type`` ("cuda", "cpu") trains it: on GPUs,
    unless --batch_size was given (or set by a --preset), the training section's
    ``gpu_batch_size``; and the line that says what it chose and why (empty where nothing
    changed). The job, its plan preview and --check_plan all plan and train with what this
    returns."""
    batch_size = type(cfg.training).gpu_batch_size
    if device_type != "cuda" or not batch_size or "batch_size" in cfg.explicit:
        return cfg, ""
    return cfg.replace(batch_size=batch_size), f"batch_size {batch_size} per GPU (GPU default; --batch_size sets it)"


def check_run_length(training: TrainingConfig, evaluation: EvaluationConfig, synthetic: bool) -> None:
    """What can be refused before the data is open: epochs of (``synthetic``) data that has none,
    or the whole of its splits (evaluation batches 0), which never end; early stopping without
    validations to stop on."""
    if synthetic and training.epochs != 1:
        raise ConfigError(
            f"--epochs {training.epochs}: synthetic data never repeats, so it has no epochs; give --steps instead"
        )
    for name in ("val_batches", "test_batches"):
        if synthetic and not getattr(evaluation, name):
            raise ConfigError(
                f"--{name} 0 means the whole split, but synthetic data's splits have no end: give a number "
                f"of batches, e.g. --{name} {field_default(EvaluationConfig.__dataclass_fields__[name])}"
            )
    if evaluation.early_stopping_patience and synthetic and not evaluation.val_every_steps:
        raise ConfigError(
            f"--early_stopping_patience {evaluation.early_stopping_patience} needs validations "
            "during training, but synthetic data validates only at the end: give --val_every_steps"
        )


def check_evaluation_only(evaluation: EvaluationConfig, checkpoint: CheckpointConfig) -> None:
    """Evaluating a checkpoint (--evaluate_checkpoint) needs the folder that holds it."""
    if evaluation.evaluate_checkpoint and not checkpoint.checkpoint_dir:
        raise ConfigError(
            f"--evaluate_checkpoint {evaluation.evaluate_checkpoint} evaluates a checkpoint of "
            "--checkpoint_dir: give the --checkpoint_dir the training run wrote"
        )


def require_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"--{name} {value} must be positive")


def require_not_negative(name: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"--{name} {value} must be 0 or more")
