"""The one typed configuration of a DLRM training run: the DLRM's model and data sections, composed
with the sections every app shares (:mod:`apps.core.config`).

``JobConfig`` is validated once, when it is constructed: by the app's command line
(``python -m apps.dlrm.train --help``) and by the TorchX component
(``torchx run components.dlrm:train --help``), whose arguments are these same fields.
"""

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from apps.core.common.errors import ConfigError
from apps.core.config import (
    CheckpointConfig,
    EvaluationConfig,
    LaunchConfig,
    TrainingConfig,
    check_job,
    parse_train_command,
    require_positive,
)
from apps.core.options import Options, field_default, option, options_of, section
from apps.core.urls import is_here
from apps.core.zch.config import ZCH, ZchConfig, check_options_used, check_zch
from apps.dlrm import presets
from apps.dlrm.data.criteo.tables import (
    CAT_FEATURES,
    INT_FEATURES,
    PRESET_CHOICES,
    PRESET_HELP,
    feature_names,
    preset_table_sizes,
)

#: The app's name: its modules (apps.dlrm.*) and components (components.dlrm), and its jobs' and
#: run folders' where the user gives none (apps/dlrm/spec.py).
NAME = "dlrm"
INTERACTIONS = ("dot", "dcn", "projection")
DATASETS = ("synthetic", "criteo", "parquet")
DENSE_TRANSFORMS = ("none", "log1p")
CATEGORICAL_IDS = ("hash", "as_is", ZCH)
#: What --data_path names, for the sources that read one.
DATA_PATH_HELP = {
    "criteo": "the folder (or URL) that `python -m apps.dlrm.preprocess --output` wrote",
    "parquet": "a folder, glob or URL of Parquet files (e.g. s3://bucket/clicks/)",
}
#: Characters that make a --dense_columns/--sparse_columns entry (or a path) a pattern: fnmatch's and glob's.
PATTERN_CHARS = "*?["
POOLINGS = ("sum", "mean")
EARLY_STOPPING_METRICS = ("auroc", "log_loss")

#: The most sparse features, that is embedding tables. TorchRec's planner, which every job runs
#: at start-up (and --check_plan before it), searches placements in a time that grows with the
#: square of the table count: about 2 minutes for 1,000 tables on 2 CPU cores, days for 20,000.
MAX_SPARSE_FEATURES = 1024
#: The most bytes one table's float32 weights may take: torch counts a tensor's bytes in an int64.
MAX_TABLE_BYTES = 2**63 - 1
FLOAT32_BYTES = 4
#: The most ids per sample of one feature (MLPerf's DLRMv2 has at most 100): every batch holds
#: batch_size x their sum ids.
MAX_MULTI_HOT_SIZE = 1024


@dataclass(slots=True)
class ModelConfig:
    """The model: features, tables, MLPs, interaction, pooling."""

    num_dense_features: int = option(13, "Number of dense (float) input features.")
    num_sparse_features: int = option(26, "Number of sparse (categorical) features; each has its own embedding table.")
    num_embeddings: int = option(
        20_000,
        "Rows of every embedding table, unless --num_embeddings_per_feature is given.",
    )
    num_embeddings_per_feature: list[int] = option(
        [],
        "Rows of each embedding table, one comma-separated entry per sparse feature "
        "(e.g. the Criteo sizes). Empty: --num_embeddings for every table.",
    )
    table_size_preset: str = option("none", PRESET_HELP, choices=PRESET_CHOICES)
    embedding_dim: int = option(16, "Width of every embedding vector.")
    dense_arch_layer_sizes: list[int] = option([64, 16], "Bottom MLP layer sizes; the last must equal --embedding_dim.")
    over_arch_layer_sizes: list[int] = option([64, 32, 1], "Top MLP layer sizes; the last must be 1 (the click logit).")
    interaction_type: str = option(
        "dot",
        "Feature interaction: dot (pairwise dot products, the original DLRM), dcn "
        "(low-rank DCN-v2 cross net) or projection (two projection branches).",
        choices=INTERACTIONS,
    )
    dcn_num_layers: int = option(3, "Cross layers of the DCN interaction.")
    dcn_low_rank_dim: int = option(64, "Low-rank width of the DCN cross layers.")
    interaction_branch1_layer_sizes: list[int] = option(
        [128, 64],
        "Projection interaction, branch 1 MLP sizes; the last must be a multiple of --embedding_dim.",
    )
    interaction_branch2_layer_sizes: list[int] = option(
        [128, 64],
        "Projection interaction, branch 2 MLP sizes; the last must be a multiple of --embedding_dim.",
    )
    multi_hot_sizes: list[int] = option(
        [],
        "Ids per sample of each sparse feature, one comma-separated entry per feature (MLPerf's "
        "DLRMv2: 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1); each feature's ids "
        "are pooled into one vector by --pooling. Synthetic data draws that many ids; Criteo "
        "derives them from the one-hot id as MLPerf does; Parquet's list columns carry their own ids, "
        "and these sizes only tell the planner how many to expect. Empty: one id per feature.",
    )
    pooling: str = option(
        "sum",
        "How a feature's embedding vectors are pooled into one: sum or mean (the same for one id).",
        choices=POOLINGS,
    )

    def check(self) -> None:
        """Refuses a model that cannot be built, naming the option (once the data has set the
        feature counts it decides)."""
        for name in ("num_dense_features", "num_sparse_features", "num_embeddings", "embedding_dim"):
            require_positive(name, getattr(self, name))
        for name in ("dcn_num_layers", "dcn_low_rank_dim"):
            require_positive(name, getattr(self, name))
        self._check_table_sizes()
        self._check_multi_hot_sizes()
        self._check_layer_sizes()

    def _check_table_sizes(self) -> None:
        if self.num_sparse_features > MAX_SPARSE_FEATURES:
            raise ConfigError(
                f"--num_sparse_features {self.num_sparse_features} is more than "
                f"{MAX_SPARSE_FEATURES}: TorchRec's planner would take hours to place that many "
                "tables (its search time grows with the square of their count); combine "
                "features into fewer tables"
            )
        self._check_table_bytes("--num_embeddings", self.num_embeddings)
        sizes = self._sizes_per_feature()
        self._check_one_per_feature("num_embeddings_per_feature", sizes, "to use --num_embeddings for every table")
        for i, size in enumerate(sizes):
            if size <= 0:
                raise ConfigError(f"--num_embeddings_per_feature entry {i} is {size}: every table needs at least 1 row")
            self._check_table_bytes(f"--num_embeddings_per_feature entry {i}", size)

    def _check_one_per_feature(self, option: str, sizes: list[int], when_empty: str) -> None:
        """A per-feature list (``--option``) has one entry per sparse feature, or none."""
        if sizes and len(sizes) != self.num_sparse_features:
            raise ConfigError(
                f"--{option} has {len(sizes)} entries ({_fmt(sizes)}) but there are "
                f"{self.num_sparse_features} sparse features: give one size per feature, set "
                f"--num_sparse_features to match, or leave it empty {when_empty}"
            )

    def _check_multi_hot_sizes(self) -> None:
        sizes = self.multi_hot_sizes
        self._check_one_per_feature("multi_hot_sizes", sizes, "for one id per feature")
        for i, size in enumerate(sizes):
            if not 1 <= size <= MAX_MULTI_HOT_SIZE:
                raise ConfigError(
                    f"--multi_hot_sizes entry {i} is {size}: every feature has from 1 to "
                    f"{MAX_MULTI_HOT_SIZE} ids per sample"
                )

    def _check_table_bytes(self, what: str, rows: int) -> None:
        """Refuses a table torch cannot allocate, before the planner overflows on it."""
        if rows * self.embedding_dim * FLOAT32_BYTES > MAX_TABLE_BYTES:
            raise ConfigError(
                f"{what} is {rows}, too many rows: with --embedding_dim {self.embedding_dim} the "
                "table's float32 weights exceed 2**63 bytes, more than torch can address; use "
                "fewer rows (hash the ids into a smaller table)"
            )

    def _check_layer_sizes(self) -> None:
        for name in (
            "dense_arch_layer_sizes",
            "over_arch_layer_sizes",
            "interaction_branch1_layer_sizes",
            "interaction_branch2_layer_sizes",
        ):
            sizes = getattr(self, name)
            if not sizes or any(size <= 0 for size in sizes):
                raise ConfigError(f"--{name} {_fmt(sizes)!r} must be a non-empty list of positive sizes")
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ConfigError(
                f"--dense_arch_layer_sizes {_fmt(self.dense_arch_layer_sizes)} must end in "
                f"--embedding_dim ({self.embedding_dim}): the dense output is interacted with "
                "the embeddings"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ConfigError(
                f"--over_arch_layer_sizes {_fmt(self.over_arch_layer_sizes)} must end in 1: "
                "the last layer is the click logit (e.g. 64,32,1)"
            )
        if self.interaction_type == "projection":
            for name in ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"):
                last = getattr(self, name)[-1]
                if last % self.embedding_dim:
                    raise ConfigError(
                        f"--{name} must end in a multiple of --embedding_dim ({self.embedding_dim}), got {last}"
                    )

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each embedding table, one per sparse feature."""
        return self._sizes_per_feature() or [self.num_embeddings] * self.num_sparse_features

    def _sizes_per_feature(self) -> list[int]:
        """The per-feature sizes given, one by one or as --table_size_preset (derived, not
        stored: a configuration written back to a command line reads back the same)."""
        return preset_table_sizes(self.table_size_preset, self.num_embeddings_per_feature)

    @property
    def ids_per_feature(self) -> list[int]:
        """Ids per sample of each sparse feature."""
        return self.multi_hot_sizes or [1] * self.num_sparse_features


@dataclass(slots=True)
class DataConfig:
    """Where the click logs come from and how they are split and shuffled."""

    data: str = option(
        "synthetic",
        "Training data. synthetic: generated on the fly, heavy-tailed ids and labels from a "
        "hidden teacher model. criteo: Criteo click logs preprocessed by "
        "`python -m apps.dlrm.preprocess` (see --data_path). parquet: click logs in Parquet files "
        "(Spark, BigQuery, `python -m apps.dlrm.preprocess --output_format parquet`), streamed "
        "from a folder or an object store (see --data_path and --label_column).",
        choices=DATASETS,
    )
    zipf_exponent: float = option(1.1, "Synthetic data: exponent of the power law that ids are drawn from (> 0).")
    data_path: str = option(
        "",
        "Criteo: the folder (or fsspec URL, e.g. s3://bucket/criteo_npy) that "
        "`python -m apps.dlrm.preprocess --output` wrote. Its files are memory-mapped; a URL is "
        "first copied to --data_cache_dir. Parquet: a folder (every .parquet file under it, "
        "names starting with _ or . left out), a glob or a single file, local or a URL "
        "(s3://bucket/clicks/, gs://...); files are streamed where they are, each rank reading "
        "only its share of the row groups; files in natural name order are the days of "
        "--eval_days.",
    )
    data_cache_dir: str = option(
        "",
        "Criteo with a URL --data_path: the node-local folder it is copied to, a private folder "
        "of this user (created with mode 0700); files already there are reused only if their "
        "SHA-256 matches the manifest's. Empty: torchrec-dlrm-<uid>/criteo/<hash of the URL> in "
        "the system's temporary folder.",
    )
    label_column: str = option("label", "Parquet: the click label's column (0/1, any integer, float or boolean type).")
    dense_columns: list[str] = option(
        ["int_*"],
        "Parquet: the dense features' columns (integer, float or boolean), comma separated; a "
        "name with * or ? stands for every matching column, in natural order (int_2 before "
        "int_10). Named one by one, their count sets --num_dense_features; with a pattern, "
        "--num_dense_features must equal the number of matches. Nulls count as 0.",
    )
    sparse_columns: list[str] = option(
        ["cat_*"],
        "Parquet: the sparse features' columns, comma separated, patterns as in --dense_columns "
        "(whose count rule --num_sparse_features follows). An integer column is one id per "
        "sample, a list<integer> column a multi-hot feature (its lists, of any length, are the "
        "ids); a null is an empty bag. The k-th column feeds embedding table cat_k.",
    )
    categorical_ids: str = option(
        "hash",
        "Parquet: how a sparse column's integer becomes an embedding row. hash: a fixed 64-bit "
        "mix (SplitMix64) of the value, modulo the table's size; as_is: the value itself, which "
        "must be in [0, table size) (Categorify'd ids, e.g. from `python -m apps.dlrm.preprocess "
        "--output_format parquet`); zch (any source): each table a TorchRec managed-collision table "
        "that gives the most frequent ids rows of their own (--zch_eviction_policy; the ids, integer "
        "or text, hashed as with hash into a 63-bit range, not the table's; docs/data.md).",
        choices=CATEGORICAL_IDS,
    )
    zch_columns: list[str] = option(
        [],
        "The sparse columns whose tables are TorchRec managed-collision tables (as --categorical_ids zch "
        "makes every one), comma separated, e.g. user_id,item_id: columns of many raw ids, while the "
        "others stay as --categorical_ids (hash or as_is) makes them. Each entry is a sparse column or a "
        "pattern of them, e.g. C3 of --sparse_columns 'C*' (placed by the first Parquet file's columns; "
        "synthetic data: the features cat_0, cat_1, ...). Managed tables are sharded row-wise; --sharding_type is the other "
        "tables'. Empty: none (or all, with --categorical_ids zch).",
    )
    dense_transform: str = option(
        "none",
        "Parquet: what the dense values go through before the model. none: as read (already "
        "scaled, e.g. by Merlin/NVTabular's LogOp); log1p: log(1 + max(x, 0)), what Criteo's "
        "preprocessing makes of its counts, for raw counts, prices or durations (an MLP trains "
        "poorly on values in the thousands and beyond; the job warns of such columns at start). "
        "An exported model scores with the transform it trained with.",
        choices=DENSE_TRANSFORMS,
    )
    eval_days: int = option(
        1,
        "Criteo and Parquet: the last N days (files) are held out, MLPerf style: the first half "
        "of the held-out rows validates, the second half tests; the other days train.",
    )
    eval_fraction: float = option(
        1.0,
        "Criteo and Parquet: the fraction of the rows of the --eval_days days that is held out (their last "
        "rows; the others train), e.g. 0.1 to hold out the last tenth of a single file such as "
        "Kaggle's train.txt.",
    )
    shuffle: bool = option(
        True,
        "Criteo: shuffle the training rows every epoch, deterministically from --seed, in "
        "blocks of --shuffle_block_rows consecutive rows; Parquet: permute the row groups every "
        "epoch and, within --shuffle_buffer_rows, blocks of --shuffle_block_rows rows. false: file order.",
    )
    shuffle_block_rows: int = option(
        1024,
        "Criteo and Parquet: consecutive rows that stay together when shuffling; smaller blocks "
        "mix better, larger blocks read faster (Parquet: 1 permutes every row of a window).",
    )
    shuffle_buffer_rows: int = option(
        262_144,
        "Parquet: rows of a rank's consecutive row groups that are read and shuffled together in "
        "memory (a shuffle window; it holds them decoded). Larger mixes better and takes more memory.",
    )

    def check(self) -> None:
        if self.data in DATA_PATH_HELP and not self.data_path:
            raise ConfigError(f"--data {self.data} needs --data_path: {DATA_PATH_HELP[self.data]}")
        if self.data not in DATA_PATH_HELP and self.data_path:
            raise ConfigError(f"--data_path {self.data_path} is read only with --data criteo or parquet")
        if self.dense_transform != "none" and self.data != "parquet":
            raise ConfigError(
                f"--dense_transform {self.dense_transform} is read only with --data parquet: --data criteo's "
                "preprocessing already takes log(1 + max(x, 0)) of its counts, synthetic values are standard normal"
            )
        for name in ("eval_days", "shuffle_block_rows", "shuffle_buffer_rows"):
            require_positive(name, getattr(self, name))
        require_positive("zipf_exponent", self.zipf_exponent)
        if not 0 < self.eval_fraction <= 1:
            raise ConfigError(
                f"--eval_fraction {self.eval_fraction} must be in (0, 1]: the share of the "
                "--eval_days days' rows held out for validation and test"
            )


@dataclass(slots=True)
class ClickEvaluationConfig(EvaluationConfig):
    """Validation, test, logging and where the results go, with the click metrics to stop on."""

    early_stopping_metric: str = option(
        "auroc",
        "The validation metric that early stopping and the best step follow: auroc (higher is "
        "better) or log_loss (lower is better).",
        choices=EARLY_STOPPING_METRICS,
    )


@dataclass(slots=True)
class JobConfig(Options):
    """A training run's configuration, in sections; the command line and the TorchX component
    flatten them (``--batch_size``, not ``--training.batch_size``). Build it with
    :meth:`from_options` (flat names, a preset filling the options not given) or
    :func:`parse_train_config`."""

    preset: str = option(
        "none",
        "A whole recipe: dlrmv2 is MLPerf's DLRMv2 (DCNv2 interaction, layers 512,256,128 and "
        "1024,1024,512,256,1, dim 128, --table_size_preset mlperf, its multi-hot sizes, Adagrad "
        "at 0.005 without warmup or decay, 8192 samples per rank). It sets only the options left "
        "at their defaults: options given with other values win.",
        choices=presets.PRESET_CHOICES,
    )
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    training: TrainingConfig = section(TrainingConfig)
    launch: LaunchConfig = section(LaunchConfig)
    evaluation: ClickEvaluationConfig = section(ClickEvaluationConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    zch: ZchConfig = section(ZchConfig)

    def __post_init__(self) -> None:
        check_job(self)

    @property
    def synthetic(self) -> bool:
        return self.data.data == "synthetic"

    def check_own_sections(self) -> None:
        """The preset and the data first: the data decides the feature counts the model checks."""
        self._check_preset()
        self.data.check()
        self._count_features()
        self.model.check()

    def check_with_shared(self) -> None:
        """With managed-collision tables (--categorical_ids zch, --zch_columns), their options
        against the tables, the launch and the checkpoints; Criteo's folders hold rows already, not
        raw ids. Without them, no managed-collision option."""
        managed = zch_features_here(self.model, self.data)
        check_options_used(self.zch, managed != [], "--categorical_ids zch or --zch_columns")
        if managed == []:
            return
        # None: which tables depends on files not here; the trainers check their rows as they shard them
        sizes = {k: self.model.table_sizes[k] for k in managed or []}
        check_zch(self.zch, sizes, self.launch, self.checkpoint, beside_plain=self.data.categorical_ids != ZCH)
        if self.data.data == "criteo":
            option = "--categorical_ids zch" if self.data.categorical_ids == ZCH else "--zch_columns"
            raise ConfigError(
                f"{option} maps raw ids, but --data criteo's folders hold table rows already "
                "(hashed or by a vocabulary): read Criteo's raw values (text columns) with --data parquet"
            )

    @property
    def zch_features(self) -> list[int]:
        """The sparse features whose tables are managed-collision ones (:func:`zch_features`)."""
        return zch_features(self.model, self.data)

    def app_gpu_only_options(self) -> Iterator[str]:
        return iter(())  # the DLRM's GPU-only options are all shared ones

    def model_signature(self) -> dict[str, Any]:
        """The options that fix the shapes of the saved tensors (and of the optimizer states)."""
        model, training = self.model, self.training
        signature = {
            "num_dense_features": model.num_dense_features,
            "table_sizes": model.table_sizes,
            "embedding_dim": model.embedding_dim,
            "dense_arch_layer_sizes": model.dense_arch_layer_sizes,
            "over_arch_layer_sizes": model.over_arch_layer_sizes,
            "interaction_type": model.interaction_type,
            "embedding_optimizer": training.embedding_optimizer,
            "dense_optimizer": training.dense_optimizer,
        }
        if model.interaction_type == "dcn":
            signature.update(dcn_num_layers=model.dcn_num_layers, dcn_low_rank_dim=model.dcn_low_rank_dim)
        if model.interaction_type == "projection":
            signature.update(
                interaction_branch1_layer_sizes=model.interaction_branch1_layer_sizes,
                interaction_branch2_layer_sizes=model.interaction_branch2_layer_sizes,
            )
        if self.data.categorical_ids == ZCH:  # the tables' id-to-row state, its buffers the policy's
            signature.update(categorical_ids=ZCH, zch_eviction_policy=self.zch.zch_eviction_policy)
        elif self.zch_features:  # which tables have it (the features by position, as the tables are named)
            signature.update(zch_features=self.zch_features, zch_eviction_policy=self.zch.zch_eviction_policy)
        return signature

    @classmethod
    def preset_defaults(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """The --preset's values of the options not in ``given`` (presets.py: the rule)."""
        values = presets.preset_values(given.get("preset", "none"))
        return {
            name: value
            for name, value in values.items()
            if not any(option in given for option in presets.deciding_options(name))
        }

    def _check_preset(self) -> None:
        model = self.model
        if self.preset != "none" and (model.num_dense_features, model.num_sparse_features) != (
            INT_FEATURES,
            CAT_FEATURES,
        ):
            raise ConfigError(
                f"--preset {self.preset} is a model of Criteo's {INT_FEATURES} dense and "
                f"{CAT_FEATURES} sparse features: drop --num_dense_features "
                f"{model.num_dense_features} and --num_sparse_features {model.num_sparse_features}, "
                "or drop --preset and give the model's options one by one"
            )

    def _count_features(self) -> None:
        """The data decides the feature counts: Criteo's are fixed, Parquet columns named one by
        one set them."""
        model = self.model
        if self.data.data == "criteo":
            if (model.num_dense_features, model.num_sparse_features) != (INT_FEATURES, CAT_FEATURES):
                raise ConfigError(
                    f"--data criteo has {INT_FEATURES} dense and {CAT_FEATURES} sparse features: "
                    f"--num_dense_features {model.num_dense_features} and --num_sparse_features "
                    f"{model.num_sparse_features} must be {INT_FEATURES} and {CAT_FEATURES}"
                )
        elif self.data.data == "parquet":
            wrong = [
                self._count_parquet_columns(option, count)
                for option, count in (
                    ("dense_columns", "num_dense_features"),
                    ("sparse_columns", "num_sparse_features"),
                )
            ]
            if any(wrong):
                raise ConfigError("; ".join(filter(None, wrong)))

    def _count_parquet_columns(self, option: str, count: str) -> str:
        """Columns named one by one set their feature count; returns why a different count given
        too is refused (empty if it is not), for one message that names every wrong count.
        Patterns are matched, and their count checked, when the files are opened."""
        columns = getattr(self.data, option)
        if not columns or len(set(columns)) != len(columns):
            raise ConfigError(
                f"--{option} {_fmt(columns)!r} must name each column once, at least one: e.g. "
                f"--{option} {field_default(DataConfig.__dataclass_fields__[option])[0]}"
            )
        if any(is_pattern(column) for column in columns):
            return ""
        given = getattr(self.model, count)
        if given not in (len(columns), field_default(ModelConfig.__dataclass_fields__[count])):
            return (
                f"--{option} names {len(columns)} columns but --{count} is {given}: drop --{count} "
                f"(the columns set it) or name {given} columns"
            )
        setattr(self.model, count, len(columns))
        return ""


def is_pattern(text: str) -> bool:
    return any(char in text for char in PATTERN_CHARS)


def zch_features(model: ModelConfig, data: DataConfig) -> list[int]:
    """The sparse features (0-based, in feature order) whose tables are managed-collision ones:
    every one with --categorical_ids zch, those --zch_columns names, else none. Where the options
    alone cannot say (a column a --sparse_columns pattern matches), the first Parquet file's
    columns do, as the loader matches them (read once per process: this is called often)."""
    managed = _zch_features_of_options(model, data)
    if managed is None:
        # Imported on use: the Parquet room builds on this configuration, and most jobs never need it.
        from apps.dlrm.data.parquet.files import zch_positions_in_files

        managed = _some_not_all(data, zch_positions_in_files(model, data), model.num_sparse_features)
    return managed


def zch_features_here(model: ModelConfig, data: DataConfig) -> list[int] | None:
    """:func:`zch_features`, or None where it needs the files and they are not on this machine (a
    URL, a path of the cluster's): what a check before the job starts (the configuration's, a
    submission's) may leave to the trainers, which read them."""
    if _zch_features_of_options(model, data) is None and not is_here(data.data_path):
        return None
    return zch_features(model, data)


def _zch_features_of_options(model: ModelConfig, data: DataConfig) -> list[int] | None:
    """:func:`zch_features` from the options alone; None where it depends on the files."""
    count = model.num_sparse_features
    if data.categorical_ids == ZCH:
        if data.zch_columns:
            raise ConfigError(
                f"--zch_columns {','.join(data.zch_columns)} picks the managed-collision columns, but "
                "--categorical_ids zch manages every one: give --categorical_ids hash (or as_is) for the others"
            )
        return list(range(count))
    if not data.zch_columns:
        return []
    parquet = data.data == "parquet"
    entries = data.sparse_columns if parquet else feature_names(count)
    managed = zch_feature_positions(data.zch_columns, entries, count, files_decide=parquet)
    return None if managed is None else _some_not_all(data, managed, count)


def _some_not_all(data: DataConfig, managed: list[int], count: int) -> list[int]:
    if len(managed) == count:
        raise ConfigError(
            f"--zch_columns {','.join(data.zch_columns)} names every sparse column: give "
            "--categorical_ids zch instead (every table managed-collision) and drop --zch_columns"
        )
    return managed


def zch_feature_positions(
    zch_columns: list[str], entries: list[str], count: int, files_decide: bool
) -> list[int] | None:
    """The sparse features (0-based) of the ``count`` that ``entries`` (the --sparse_columns entries,
    names or patterns, with ``files_decide``; else synthetic data's feature names) resolve to which
    ``zch_columns`` names, without the files: an entry of --zch_columns is one of ``entries`` as
    written (a pattern there: all its columns), or a pattern matching names there. A pattern
    entry's columns are known by count where it is the only pattern (the others one column each).
    None where the files decide (a pattern among ``entries``): a column that a pattern matches (or
    none), or a position that depends on how many columns several patterns match."""
    sizes: list[int | None] = [None if is_pattern(entry) else 1 for entry in entries]
    if sizes.count(None) == 1:
        sizes[sizes.index(None)] = count - sum(size or 0 for size in sizes)
    starts: list[int | None] = []
    at: int | None = 0
    for size in sizes:
        starts.append(at)
        at = None if at is None or size is None else at + size
    positions: set[int] = set()
    for column in zch_columns:
        chosen = [
            i for i, e in enumerate(entries) if e == column or (not is_pattern(e) and fnmatch.fnmatchcase(e, column))
        ]
        unplaced = not chosen or any(starts[i] is None or sizes[i] is None for i in chosen)
        if unplaced and files_decide and any(is_pattern(entry) for entry in entries):
            return None
        if not chosen:
            named = (
                f"--sparse_columns {','.join(entries)}: name some of them"
                if files_decide
                else f"the synthetic sparse features: name some of {entries[0]} to {entries[-1]}"
            )
            raise ConfigError(f"--zch_columns {column} names no column of {named}")
        for i in chosen:
            start, size = starts[i], sizes[i]
            assert start is not None and size is not None  # without patterns, every entry is one feature
            positions.update(range(start, start + size))
    return sorted(positions)


class PlanConfig(JobConfig):
    """A training job's configuration as its sharding plan sees it (``python -m apps.dlrm.plan``,
    ``components.dlrm:plan``): only the options the plan depends on are offered (the model, how it
    runs on the devices, the batch size, the embedding optimizer's state, a --preset, and the data
    options that say where --zch_columns' columns fall among the features); the others
    keep their defaults, so the preview's help lists what matters to it."""

    __slots__ = ()

    OFFERED = frozenset(
        ["preset", "batch_size", "embedding_optimizer", "categorical_ids", "zch_columns"]
        # which columns --zch_columns names, where a --sparse_columns pattern matches them in the files
        + ["data", "data_path", "sparse_columns"]
        + [field.name for cls in (ModelConfig, LaunchConfig, ZchConfig) for field in options_of(cls)]
    )


def _fmt(sizes: list[int]) -> str:
    return ",".join(str(size) for size in sizes)


def parse_train_config(argv: list[str] | None = None) -> JobConfig:
    return parse_train_command(JobConfig, NAME, "a sharded DLRM", argv)


def train_config(**options: Any) -> JobConfig:
    """The configuration of ``options`` (flat names, as on the command line), the others at
    their defaults or their --preset's values: the form for code and tests."""
    return JobConfig.from_options(options)
