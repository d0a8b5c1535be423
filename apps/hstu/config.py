"""The HSTU app's own option sections: the model and the sequence data.

Both are dataclasses of :func:`apps.core.options.option` fields, flattened onto the command line
next to the sections every app shares (training, launch, evaluation, checkpoint), so none of
their names may be one of those. Each has a ``check()`` that refuses a value in one line naming
the option and the fix.
"""

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Mapping

from apps.core.common.errors import ConfigError
from apps.core.config import (
    DENSE_OPTIMIZERS,
    CheckpointConfig,
    EvaluationConfig,
    LaunchConfig,
    TrainingConfig,
    check_job,
    parse_train_command,
    require_positive,
)
from apps.core.options import Options, option, options_of, section
from apps.core.zch.config import ZCH, ZchConfig, check_options_used, check_zch

#: The app's name: its modules (apps.hstu.*) and components (components.hstu), and its jobs' and
#: run folders' where the user gives none (apps/hstu/spec.py).
NAME = "hstu"
OBJECTIVES = ("retrieval", "ranking")
ATTENTION_KERNELS = ("pytorch", "fused")
FUSED_NEEDS_CUDA = (
    "--attention_kernel fused needs a CUDA GPU (FBGEMM's HSTU kernel is CUDA only): use --attention_kernel pytorch"
)
SEQUENCE_DATASETS = ("synthetic", "parquet")
LAYOUTS = ("per_user", "per_event")
#: --categorical_ids: item ids that are the item table's rows, or raw ids TorchRec's managed-collision
#: module maps to rows (apps/core/zch/).
CATEGORICAL_IDS = ("as_is", ZCH)


#: The run's length on synthetic users when --steps is 0 (see SequenceTrainingConfig).
HSTU_SYNTHETIC_STEPS = 500

#: The model's sizes: each must be positive.
SIZE_OPTIONS = (
    "num_items",
    "num_actions",
    "embedding_dim",
    "num_layers",
    "num_heads",
    "attention_dim",
    "linear_dim",
    "max_seq_len",
    "num_time_buckets",
)


@dataclass(slots=True)
class HSTUModelConfig:
    """The model: the item and action tables, the HSTU layer stack and the objective."""

    num_items: int = option(2000, "Rows of the item table: item ids are in [0, num_items).")
    num_actions: int = option(4, "Rows of the action (event type) table: action ids are in [0, num_actions).")
    embedding_dim: int = option(64, "Width of the item and action embeddings and of every HSTU layer's input.")
    num_layers: int = option(2, "HSTU layers.")
    num_heads: int = option(2, "Attention heads of every HSTU layer.")
    attention_dim: int = option(32, "Width of each head's queries and keys.")
    linear_dim: int = option(32, "Width of each head's values and gates (U, V).")
    max_seq_len: int = option(50, "Most events of a user the model reads: the last ones, earlier events are left out.")
    num_time_buckets: int = option(
        32, "Buckets (logarithmic in seconds) of the time between two events, each with a learned attention bias."
    )
    position_embedding: bool = option(True, "Add a learned embedding of each event's position in the sequence.")
    dropout: float = option(0.0, "Dropout of the layers' outputs in training, in [0, 1).")
    objective: str = option(
        "retrieval",
        "retrieval: predict the next item, sampled softmax over in-batch and random negatives; "
        "ranking: predict each event's action from the items so far, one logit per action (BCE).",
        choices=OBJECTIVES,
    )
    num_negatives: int = option(
        8, "Retrieval: random negative items per user, shared by the whole batch with its in-batch negatives."
    )
    temperature: float = option(0.05, "Retrieval: temperature of the softmax over L2-normalised embeddings.")
    attention_kernel: str = option(
        "pytorch",
        "pytorch: padded attention in plain PyTorch (any device); fused: FBGEMM's HSTU attention "
        "kernel (fbgemm_gpu's experimental hstu package, CUDA only), where installed.",
        choices=ATTENTION_KERNELS,
    )

    def check(self) -> None:
        for name in SIZE_OPTIONS:
            require_positive(name, getattr(self, name))
        require_positive("temperature", self.temperature)
        if self.num_negatives < 0:
            raise ConfigError(f"--num_negatives {self.num_negatives} must be 0 or more")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout {self.dropout} must be in [0, 1)")
        if self.max_seq_len < 2:
            raise ConfigError(f"--max_seq_len {self.max_seq_len} must be at least 2: a history and its next event")


@dataclass(slots=True)
class SequenceDataConfig:
    """Where the users' event sequences come from, and how they are evaluated."""

    data: str = option(
        "synthetic",
        "synthetic: users generated from a hidden item-transition process whose best possible "
        "HR/NDCG is known exactly (the ceiling); parquet: sequences in Parquet files (--data_path, --layout).",
        choices=SEQUENCE_DATASETS,
    )
    data_path: str = option(
        "", "Parquet: a file, folder (every .parquet under it) or glob, local or any fsspec URL (s3://, gs://)."
    )
    layout: str = option(
        "per_user",
        "Parquet: per_user: one row per user, list columns of item ids, timestamps and event types "
        "(Yambda-style); per_event: one row per event (user, item, action, timestamp; MovieLens-style), "
        "grouped per user and sorted by timestamp.",
        choices=LAYOUTS,
    )
    user_column: str = option("user_id", "Parquet per_event: the user id column (any integer or string type).")
    item_column: str = option(
        "item_id",
        "Parquet: the item ids' column: integers in [0, --num_items); with --categorical_ids zch any "
        "64-bit integers or text (per_user: a list column).",
    )
    categorical_ids: str = option(
        "as_is",
        "as_is: item ids are the item table's rows, in [0, --num_items); zch: raw item ids (any "
        "64-bit integers; synthetic items are hashed into them), which a TorchRec managed-collision "
        "table of --num_items rows maps to rows, giving the most frequent ids rows of their own "
        "(--zch_eviction_policy; docs/hstu.md).",
        choices=CATEGORICAL_IDS,
    )
    action_column: str = option(
        "event_type",
        "Parquet: the actions' column, integers in [0, --num_actions) (per_user: a list column; "
        "MovieLens: rating, with --num_actions 6); empty: every event has action 0.",
    )
    timestamp_column: str = option(
        "timestamp", "Parquet: the events' times in seconds, integers (per_user: a list column)."
    )
    synthetic_branching: int = option(
        4, "Synthetic: successors of each item in the hidden transition process (weights halving)."
    )
    synthetic_noise: float = option(
        0.2, "Synthetic: probability that the next item is uniform over all items instead of a successor."
    )
    synthetic_min_events: int = option(
        8, "Synthetic: fewest events of a user (lengths are uniform up to --max_seq_len + 2)."
    )
    eval_negatives: int = option(
        0,
        "Evaluation: rank the target among this many random items (and itself); 0: among all items, "
        "scored in chunks through the same embedding table.",
    )
    eval_chunk_items: int = option(65536, "Evaluation over all items: items scored per chunk.")

    def check(self) -> None:
        if self.data == "parquet" and not self.data_path:
            raise ConfigError("--data parquet needs --data_path: a Parquet file, folder, glob or URL")
        if self.data != "parquet" and self.data_path:
            raise ConfigError(f"--data_path {self.data_path} is read only with --data parquet")
        for name in ("synthetic_branching", "eval_chunk_items"):
            require_positive(name, getattr(self, name))
        if self.synthetic_min_events < 3:
            raise ConfigError(
                f"--synthetic_min_events {self.synthetic_min_events} must be at least 3: "
                "a training event, the validation target and the test target"
            )
        if not 0 <= self.synthetic_noise <= 1:
            raise ConfigError(f"--synthetic_noise {self.synthetic_noise} must be in [0, 1]")
        if self.eval_negatives < 0:
            raise ConfigError(f"--eval_negatives {self.eval_negatives} must be 0 (all items) or more")
        if self.data == "parquet" and self.layout == "per_event" and not self.user_column:
            raise ConfigError("--layout per_event needs --user_column: the events are grouped per user")

    def check_with(self, model: HSTUModelConfig) -> None:
        """The checks that need the model's options too."""
        if self.synthetic_branching > model.num_items:
            raise ConfigError(
                f"--synthetic_branching {self.synthetic_branching} is more than --num_items "
                f"{model.num_items}: each successor of an item is a different item"
            )
        if self.data == "synthetic" and self.synthetic_min_events > model.max_seq_len + 2:
            raise ConfigError(
                f"--synthetic_min_events {self.synthetic_min_events} must be at most --max_seq_len + 2 "
                f"({model.max_seq_len + 2})"
            )
        if self.eval_negatives >= model.num_items:
            raise ConfigError(
                f"--eval_negatives {self.eval_negatives} must be fewer than --num_items {model.num_items} "
                "(or 0 to rank among all items)"
            )


#: The model's options that fix the shapes of its tensors (a checkpoint's model signature).
SIGNATURE_OPTIONS = (*SIZE_OPTIONS, "position_embedding", "objective")
#: --sharding_type values TorchRec cannot run on the HSTU's tables (an ``EmbeddingCollection``),
#: and why: refused when the options are read rather than when the ranks shard the model.
UNSHARDABLE = {
    "table_row_wise": "TorchRec's EmbeddingCollection sharder has no table_row_wise",
    "data_parallel": "TorchRec 1.8.0 fails to replicate an EmbeddingCollection on CPUs "
    "(construct_jagged_tensors splits its lookups wrongly)",
}
#: The validation metrics early stopping may follow (apps/hstu/metrics.py): leave-last-out ranking
#: of the next item (retrieval), or the mean AUROC of the action heads (ranking).
EARLY_STOPPING_METRICS = ("ndcg@10", "hr@10", "mrr", "auroc")


@dataclass(slots=True)
class SequenceTrainingConfig(TrainingConfig):
    """How the HSTU learns: the shared options, with the learning rates and dense optimizer its
    sampled softmax needs (Adagrad at DLRM's rates leaves it far below the synthetic ceiling), and a
    default run on synthetic users as long as the DLRM's: a user's sequence costs far more than a
    click's sample, and 500 steps of 128 users a rank come within 0.08 of the ceiling."""

    synthetic_steps: ClassVar[int] = HSTU_SYNTHETIC_STEPS
    #: None: 128 users a rank is already the per-GPU batch of the reference HSTU's recipes
    #: (generative-recommenders' ML-1M configs: local_batch_size 128), each user tens of events
    #: that its attention steps over together, and the HSTU has not yet been measured on a GPU.
    gpu_batch_size: ClassVar[int | None] = None

    batch_size: int = option(128, "Training users (sequences) per rank per step.")
    steps: int = option(
        0,
        "Training steps (batches per rank), at most. 0: --epochs of Parquet data, "
        f"{HSTU_SYNTHETIC_STEPS} steps of synthetic data (which never repeats, so has no epochs).",
    )
    learning_rate: float = option(0.2, "Learning rate of the embedding tables.")
    dense_learning_rate: float = option(0.002, "Learning rate of the HSTU layers; 0 uses --learning_rate.")
    dense_optimizer: str = option("adam", "Optimizer of the HSTU layers.", choices=DENSE_OPTIMIZERS)


@dataclass(slots=True)
class SequenceEvaluationConfig(EvaluationConfig):
    """Validation, test, logging and where the results go, with the HSTU's metrics to stop on."""

    early_stopping_metric: str = option(
        "ndcg@10",
        "The validation metric that early stopping and the best step follow (higher is better): "
        "ndcg@10, hr@10 or mrr of the held-out next item (--objective retrieval), auroc (ranking).",
        choices=EARLY_STOPPING_METRICS,
    )


@dataclass(slots=True)
class JobConfig(Options):
    """An HSTU training run's configuration: the HSTU's model and data sections and the sections
    every app shares (:mod:`apps.core.config`), flat on the command line
    (``python -m apps.hstu.train --help``, ``torchx run components.hstu:train --help``)."""

    model: HSTUModelConfig = section(HSTUModelConfig)
    data: SequenceDataConfig = section(SequenceDataConfig)
    zch: ZchConfig = section(ZchConfig)
    training: SequenceTrainingConfig = section(SequenceTrainingConfig)
    launch: LaunchConfig = section(LaunchConfig)
    evaluation: SequenceEvaluationConfig = section(SequenceEvaluationConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)

    def __post_init__(self) -> None:
        check_job(self)

    @property
    def synthetic(self) -> bool:
        return self.data.data == "synthetic"

    def check_own_sections(self) -> None:
        self.model.check()
        self.data.check()
        self.data.check_with(self.model)

    def check_with_shared(self) -> None:
        self._check_metric()
        self._check_sharding()
        check_options_used(self.zch, self.data.categorical_ids == ZCH)
        if self.data.categorical_ids == ZCH:
            self._check_zch()

    def _check_zch(self) -> None:
        """The managed-collision options against the item table, the launch and the checkpoints;
        evaluation ranks among the ids that have rows, as random raw ids are no items."""
        check_zch(self.zch, [self.model.num_items], self.launch, self.checkpoint, "--num_items")
        if self.data.eval_negatives:
            raise ConfigError(
                f"--eval_negatives {self.data.eval_negatives} draws random item ids, which are no items with "
                "--categorical_ids zch (its ids are raw): give --eval_negatives 0 (rank among every item with a row)"
            )

    @classmethod
    def preset_defaults(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """A ranking objective follows its AUROC unless --early_stopping_metric is given (the
        field's default, ndcg@10, is a retrieval metric)."""
        return {"early_stopping_metric": "auroc"} if given.get("objective") == "ranking" else {}

    def _check_metric(self) -> None:
        metric, objective = self.evaluation.early_stopping_metric, self.model.objective
        if (metric == "auroc") != (objective == "ranking"):
            wanted = "auroc" if objective == "ranking" else "ndcg@10, hr@10 or mrr"
            raise ConfigError(
                f"--early_stopping_metric {metric} is not measured with --objective {objective}: give {wanted}"
            )

    def _check_sharding(self) -> None:
        kind = self.launch.sharding_type
        if kind in UNSHARDABLE:
            raise ConfigError(
                f"--sharding_type {kind} cannot shard the HSTU's tables: {UNSHARDABLE[kind]}; "
                "give auto, table_wise, row_wise or column_wise"
            )

    def app_gpu_only_options(self) -> Iterator[str]:
        if self.model.attention_kernel == "fused":
            yield FUSED_NEEDS_CUDA

    def model_signature(self) -> dict[str, Any]:
        """The options that fix the shapes of the saved tensors (and of the optimizer states)."""
        model = self.model
        signature = {
            **{name: getattr(model, name) for name in SIGNATURE_OPTIONS},
            "embedding_optimizer": self.training.embedding_optimizer,
            "dense_optimizer": self.training.dense_optimizer,
        }
        if self.data.categorical_ids == ZCH:  # the item table's id-to-row state, its buffers the policy's
            signature.update(categorical_ids=ZCH, zch_eviction_policy=self.zch.zch_eviction_policy)
        return signature


def parse_train_config(argv: list[str] | None = None) -> JobConfig:
    return parse_train_command(JobConfig, NAME, "a sharded HSTU generative recommender", argv)


def train_config(**options: Any) -> JobConfig:
    """The configuration of ``options`` (flat names, as on the command line), the others at
    their defaults: the form for code and tests."""
    return JobConfig.from_options(options)


class PlanConfig(JobConfig):
    """An HSTU training job's configuration as its sharding plan sees it (``python -m
    apps.hstu.plan``, ``components.hstu:plan``): the model, how it runs on the devices, the batch
    size and the embedding optimizer's state; the other options keep their defaults."""

    __slots__ = ()

    OFFERED = frozenset(
        ["batch_size", "embedding_optimizer", "categorical_ids"]
        + [field.name for cls in (HSTUModelConfig, LaunchConfig, ZchConfig) for field in options_of(cls)]
    )
