"""The Criteo click logs' features (the names every DLRM source keys its sparse features by), and
their embedding tables' sizes by name.

Free of numpy and of the data code: the configuration, and with it every ``torchx run`` of a
component, reads these.

The presets are the ``--num_embeddings_per_feature`` lists of TorchRec's DLRM example on the
Criteo 1TB click logs (reference 002): ``mlperf`` caps every table at 40M rows (MLPerf's DLRM
configuration, 97 GiB of tables at dimension 128), ``mlperf_x2`` at 80M, and ``full`` gives every
categorical feature as many rows as it has distinct values in the 24 days.
"""

from apps.core.common.errors import ConfigError

INT_FEATURES = 13
CAT_FEATURES = 26


def feature_names(num_sparse_features: int) -> list[str]:
    """Sparse feature names, the keys of every DLRM batch's KeyedJaggedTensor and of the model's
    tables; the first 26 match TorchRec's Criteo names (``cat_0`` ...)."""
    return [f"cat_{i}" for i in range(num_sparse_features)]


#: Ids per sample of each of the 26 Criteo features in MLPerf's DLRMv2 (``--multi_hot_sizes`` of
#: TorchRec's torchrec_dlrm example and of MLPerf's reference, recommendation_v2/torchrec_dlrm).
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]

# 26 sizes per preset, in feature order, as TorchRec's example writes them.
# fmt: off
TABLE_SIZE_PRESETS: dict[str, list[int]] = {
    "mlperf": [
        40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
        2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
    ],
    "mlperf_x2": [
        80000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 80000000, 3067956, 405282, 10,
        2209, 11938, 155, 4, 976, 14, 80000000, 40790948, 80000000, 590152, 12973, 108, 36,
    ],
    "full": [
        227605432, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 130229467, 3067956, 405282, 10,
        2209, 11938, 155, 4, 976, 14, 292775614, 40790948, 187188510, 590152, 12973, 108, 36,
    ],
}
# fmt: on
PRESET_CHOICES = ("none", *TABLE_SIZE_PRESETS)

PRESET_HELP = (
    "Embedding-table sizes of TorchRec's DLRM on the Criteo 1TB click logs, instead of typing "
    "26 numbers into --num_embeddings_per_feature: mlperf (tables capped at 40M rows, MLPerf's "
    "DLRM), mlperf_x2 (80M), full (every distinct value its own row); none: "
    "--num_embeddings_per_feature or --num_embeddings decide."
)


def preset_table_sizes(preset: str, num_embeddings_per_feature: list[int]) -> list[int]:
    """The per-feature sizes that ``preset`` stands for (``num_embeddings_per_feature`` if none).

    Both may be given only if they agree, so a config that was expanded once (and then written
    back to a command line) reads back the same.
    """
    if preset == "none":
        return num_embeddings_per_feature
    sizes = TABLE_SIZE_PRESETS[preset]
    if num_embeddings_per_feature and num_embeddings_per_feature != sizes:
        raise ConfigError(
            f"--table_size_preset {preset} and --num_embeddings_per_feature "
            f"{','.join(map(str, num_embeddings_per_feature))} both give the table sizes: "
            "give only one of them"
        )
    return list(sizes)
