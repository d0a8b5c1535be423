"""Whole training recipes by name: ``--preset``.

A preset is a set of option values. It fills only the options a run does not give: an option
given wins over the preset (``--preset dlrmv2 --batch_size 256`` trains MLPerf's model with
batches of 256), even when given at its default value (``--preset dlrmv2 --batch_size 512``
trains with 512: the app's parser knows what was given, :func:`apps.core.options.add_options`).
The TorchX component cannot tell: TorchX hands it every argument, given or not, so there an
argument at its default value counts as not given and takes the preset's value. The table sizes
are one choice made by three options: the preset's ``--table_size_preset`` applies only when none
of ``--num_embeddings``, ``--num_embeddings_per_feature`` and ``--table_size_preset`` is given.
"""

from typing import Any

from apps.dlrm.data.criteo.tables import MLPERF_MULTI_HOT_SIZES

#: MLPerf Training's DLRMv2 (DCNv2) benchmark, as its reference trains it (mlcommons/training
#: recommendation_v2/torchrec_dlrm, README and dlrm_main.py; the limits in MLPerf's
#: training_rules.adoc): DCNv2 low-rank interaction, Criteo 1TB's tables capped at 40M rows,
#: multi-hot features, Adagrad for tables and MLPs at one learning rate with no warmup or decay,
#: and a global batch of 65,536 (8,192 per rank on the reference's 8 GPUs).
DLRMV2: dict[str, Any] = {
    "embedding_dim": 128,
    "dense_arch_layer_sizes": [512, 256, 128],
    "over_arch_layer_sizes": [1024, 1024, 512, 256, 1],
    "interaction_type": "dcn",
    "dcn_num_layers": 3,
    "dcn_low_rank_dim": 512,
    "table_size_preset": "mlperf",
    "multi_hot_sizes": MLPERF_MULTI_HOT_SIZES,
    "pooling": "sum",
    "embedding_optimizer": "adagrad",
    "dense_optimizer": "adagrad",
    "learning_rate": 0.005,
    "dense_learning_rate": 0.0,  # 0: the tables' --learning_rate
    "lr_warmup_steps": 0,
    "lr_decay_start": 0,
    "lr_decay_steps": 0,
    "batch_size": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {"dlrmv2": DLRMV2}
PRESET_CHOICES = ("none", *PRESETS)

#: Options that decide together: a preset's value of the key applies only if all are unset.
GROUPS: dict[str, tuple[str, ...]] = {
    "table_size_preset": ("table_size_preset", "num_embeddings", "num_embeddings_per_feature"),
}


def preset_values(preset: str) -> dict[str, Any]:
    """The option values of ``preset`` ("none": no values)."""
    return PRESETS.get(preset, {})


def deciding_options(name: str) -> tuple[str, ...]:
    """The options that, given, keep a preset from setting ``name``."""
    return GROUPS.get(name, (name,))
