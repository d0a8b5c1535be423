"""The typed configurations of export and prediction: the command lines of ``python -m
apps.dlrm.export`` and ``python -m apps.dlrm.predict``, and the arguments of the TorchX components
``components.dlrm:export`` and ``components.dlrm:predict``."""

from dataclasses import dataclass

from apps.core.common.errors import ConfigError
from apps.core.options import Options, check_choices, option, parse_config
from apps.core.urls import redact_urls
from apps.dlrm.config import DATA_PATH_HELP

#: --quantize: the tables' dtype in the package (none: as trained, float32).
QUANTIZE = ("none", "fp16", "int8")
#: What --step takes besides a step number.
NAMED_STEPS = ("best", "latest")
#: What prediction reads.
PREDICT_DATA = ("parquet", "criteo", "criteo_tsv")
#: What --data_path names, per --data.
PREDICT_DATA_PATH_HELP = {
    **DATA_PATH_HELP,
    "criteo_tsv": "Criteo TSV click logs (plain or gzip) as preprocessing's --input takes them: a file, a folder of "
    "them, a glob or a URL (e.g. s3://bucket/criteo/day_23.gz)",
}
_STEP_HELP = "Which checkpoint: best (the one the BEST marker names: the best validation's), latest, or a step number."


@dataclass
class ExportConfig(Options):
    checkpoint_dir: str = option(
        "",
        "The --checkpoint_dir a training run wrote: a folder or fsspec URL (s3://, gs://), its checkpoints of "
        "any sharding and world size.",
    )
    step: str = option("best", _STEP_HELP)
    output: str = option(
        "",
        "Where the package goes: a folder or fsspec URL that does not exist or is empty (nothing is "
        "overwritten); written atomically.",
    )
    quantize: str = option(
        "none",
        "The embedding tables in the package: none (float32, as trained), fp16, or int8 (row-wise: 8 bits "
        "per value with a scale and bias per row), looked up by FBGEMM's inference kernels.",
        choices=QUANTIZE,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        _require("checkpoint_dir", self.checkpoint_dir, "the --checkpoint_dir of the training run")
        _require("output", self.output, "where the package goes, e.g. --output s3://bucket/dlrm-package")
        check_step(self.step)


@dataclass
class PredictConfig(Options):
    model: str = option(
        "",
        "An inference package (the --output of components.dlrm:export), or a training run's --checkpoint_dir "
        "(see --step), whose model every rank then loads whole.",
    )
    step: str = option("best", f"With a checkpoint folder as --model: {_STEP_HELP[0].lower()}{_STEP_HELP[1:]}")
    data: str = option(
        "parquet",
        "What to score. parquet: Parquet files (see --data_path), their rows read as the model trained on "
        "them; criteo: a folder written by `python -m apps.dlrm.preprocess` (its days' arrays); criteo_tsv: "
        "Criteo's raw click logs, made into ids and dense values as the model's preprocessed folder made them "
        "(see --preprocessed_path).",
        choices=PREDICT_DATA,
    )
    data_path: str = option(
        "",
        f"Parquet: {DATA_PATH_HELP['parquet']}, each rank scoring its share of the files. Criteo: "
        f"{DATA_PATH_HELP['criteo']}, each rank scoring its share of the days. Criteo TSV: "
        f"{PREDICT_DATA_PATH_HELP['criteo_tsv']}, each rank scoring its share of the files.",
    )
    preprocessed_path: str = option(
        "",
        "Criteo TSV: the folder (or URL) `python -m apps.dlrm.preprocess` wrote that the model trained on, or a "
        "copy: its manifest.json says how values became ids (hash: modulo its table sizes; vocabulary: its "
        "vocabulary/ tables, which must be local). Empty: the training run's --data_path, as the checkpoint or "
        "package records it.",
    )
    data_cache_dir: str = option(
        "", "Criteo with a URL --data_path: the node-local folder it is copied to (as for training)."
    )
    dense_columns: list[str] = option(
        [], "Parquet: the dense features' columns, patterns as for training. Empty: those the model trained on."
    )
    sparse_columns: list[str] = option(
        [], "Parquet: the sparse features' columns, patterns as for training. Empty: those the model trained on."
    )
    passthrough_columns: list[str] = option(
        [],
        "Columns copied into the predictions beside the score, comma separated (e.g. a row id, the label). "
        "Criteo and Criteo TSV: label and row (the row's number in its day, among the lines kept).",
    )
    output: str = option(
        "",
        "Where the predictions go: a folder or fsspec URL that does not exist or is empty (nothing is "
        "overwritten). One Parquet file per input file (columns: --passthrough_columns, then score), each "
        "written whole, and report.json last.",
    )
    batch_size: int = option(8192, "Rows scored at once.")

    def __post_init__(self) -> None:
        check_choices(self)
        _require("model", self.model, "an inference package or a training run's --checkpoint_dir")
        _require("data_path", self.data_path, PREDICT_DATA_PATH_HELP[self.data])
        if self.preprocessed_path and self.data != "criteo_tsv":
            raise ConfigError(
                f"--preprocessed_path {redact_urls(self.preprocessed_path)} is read only with --data criteo_tsv: "
                "leave it out"
            )
        _require("output", self.output, "where the predictions go, e.g. --output s3://bucket/scores/")
        check_step(self.step)
        if self.batch_size <= 0:
            raise ConfigError(f"--batch_size {self.batch_size} must be positive")
        if "score" in self.passthrough_columns:
            raise ConfigError("--passthrough_columns score: the predictions' own column is named score; leave it out")
        twice = sorted({name for name in self.passthrough_columns if self.passthrough_columns.count(name) > 1})
        if twice:
            raise ConfigError(
                f"--passthrough_columns {','.join(self.passthrough_columns)} names {', '.join(twice)} more than "
                "once: a column is copied into the predictions once; name each once"
            )


def check_step(step: str) -> None:
    """Refuses a --step that is neither best, latest nor a step number."""
    if step not in NAMED_STEPS and not step.isdigit():
        raise ConfigError(f"--step {step!r}: give best, latest or a step number (e.g. --step 1500)")


def _require(name: str, value: str, what: str) -> None:
    if not value:
        raise ConfigError(f"--{name} is missing: give {what}")


def parse_export_config(argv: list[str] | None = None) -> ExportConfig:
    return parse_config(
        ExportConfig,
        argv,
        prog="python -m apps.dlrm.export",
        description="Turn a training run's checkpoint into an inference package: the unsharded model as a "
        "torch.export program (tables optionally quantized) and its manifest.",
    )


def parse_predict_config(argv: list[str] | None = None) -> PredictConfig:
    return parse_config(
        PredictConfig,
        argv,
        prog="python -m apps.dlrm.predict",
        description="Score Parquet files, a preprocessed Criteo folder or Criteo click logs with an inference package or a "
        "checkpoint; one Parquet file of predictions per input file. Run it under torchrun (or `torchx run "
        "components.dlrm:predict`) to share the files among ranks; alone it is one process.",
    )
