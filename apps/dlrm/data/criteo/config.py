"""The typed configuration of Criteo preprocessing.

``PreprocessConfig``'s fields are both the command line of ``python -m apps.dlrm.preprocess``
and the arguments of the TorchX component ``components.dlrm:preprocess``.
"""

from dataclasses import dataclass

from apps.core.common.errors import ConfigError
from apps.core.options import Options, check_choices, option, parse_config
from apps.dlrm.data.criteo.tables import CAT_FEATURES, PRESET_CHOICES, PRESET_HELP, preset_table_sizes

CATEGORICAL_IDS = ("hash", "vocabulary")
OUTPUT_FORMATS = ("npy", "parquet")

# Ids are stored as int32 (the dtype of TorchRec's binary Criteo files).
MAX_TABLE_SIZE = 2**31 - 1


@dataclass
class PreprocessConfig(Options):
    input: list[str] = option(
        [],
        "Criteo TSV click logs (plain or gzip): files, folders of them (every file not starting "
        "with '.'), glob patterns or fsspec URLs (s3://bucket/criteo/day_*.gz), comma separated. "
        "Each file becomes one day of the output, in natural order of the names (day_2 before "
        "day_10).",
    )
    output: str = option(
        "",
        "Local folder that receives the preprocessed days, manifest.json and report.json. A "
        "rerun with the same settings skips the days that are already complete.",
    )
    num_embeddings: int = option(
        20_000,
        "Rows of every embedding table (ids of each categorical feature are in [0, N)), unless "
        "--num_embeddings_per_feature or --table_size_preset is given. Train with the same sizes.",
    )
    num_embeddings_per_feature: list[int] = option([], "Rows of each of the 26 embedding tables, comma separated.")
    table_size_preset: str = option("none", PRESET_HELP, choices=PRESET_CHOICES)
    categorical_ids: str = option(
        "hash",
        "How a categorical value (32 bits) becomes an embedding row: hash (the value modulo the "
        "table size, as TorchRec's and MLPerf's DLRM) or vocabulary (values numbered in order of "
        "first appearance from 2, values seen fewer than --frequency_threshold times all 1, then "
        "modulo the table size, as TorchRec's sparse_to_contiguous; needs a counting pass over "
        "all inputs first).",
        choices=CATEGORICAL_IDS,
    )
    frequency_threshold: int = option(
        3,
        "With --categorical_ids vocabulary: values seen fewer times than this in all inputs "
        "share id 1; 0 or 1: every value gets its own id.",
    )
    output_format: str = option(
        "npy",
        "How each day is written: npy (three NumPy arrays, memory-mapped by --data criteo) or "
        "parquet (one <day>.parquet file of columns label, int_0..int_12, cat_0..cat_25 holding the "
        "same values, in row groups of 131,072 rows: NVTabular's kind of output, trained on with "
        "--data parquet --categorical_ids as_is, also from an object store).",
        choices=OUTPUT_FORMATS,
    )
    workers: int = option(0, "Processes converting files in parallel, one file each; 0: one per available core.")

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.input:
            raise ConfigError(
                "--input is missing: give the Criteo TSV files, a folder of them or a URL "
                "(e.g. --input /data/criteo/day_0.gz,/data/criteo/day_1.gz or --input s3://bucket/criteo/)"
            )
        if not self.output:
            raise ConfigError("--output is missing: give the folder that receives the preprocessed files")
        if "://" in self.output and not self.output.startswith("file://"):
            raise ConfigError(
                f"--output {self.output} is a URL: preprocessing writes to a local (or mounted) "
                "folder; copy the folder to object storage afterwards if training reads it from there"
            )
        self.num_embeddings_per_feature = preset_table_sizes(self.table_size_preset, self.num_embeddings_per_feature)
        sizes = self.table_sizes
        if len(sizes) != CAT_FEATURES:
            raise ConfigError(
                f"--num_embeddings_per_feature has {len(sizes)} entries but Criteo has "
                f"{CAT_FEATURES} categorical features: give one size per feature"
            )
        for i, size in enumerate(sizes):
            if not 1 <= size <= MAX_TABLE_SIZE:
                raise ConfigError(
                    f"table size {size} of categorical feature {i} is out of range: ids are "
                    f"stored as int32, so every table needs 1 to {MAX_TABLE_SIZE} rows"
                )
        if self.frequency_threshold < 0:
            raise ConfigError(f"--frequency_threshold {self.frequency_threshold} must be 0 or more")
        if self.workers < 0:
            raise ConfigError(f"--workers {self.workers} must be 0 (all cores) or more")

    @property
    def table_sizes(self) -> list[int]:
        return self.num_embeddings_per_feature or [self.num_embeddings] * CAT_FEATURES


def parse_preprocess_config(argv: list[str] | None = None) -> PreprocessConfig:
    return parse_config(
        PreprocessConfig,
        argv,
        prog="python -m apps.dlrm.preprocess",
        description="Convert Criteo TSV click logs into memory-mappable binary files for "
        "training (--data criteo --data_path OUTPUT).",
    )
