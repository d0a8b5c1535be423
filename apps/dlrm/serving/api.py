"""Scoring in a notebook::

    from apps.dlrm.serving.api import load_model

    model = load_model("s3://bucket/dlrm-package")      # or a training run's --checkpoint_dir
    scores = model(table)   # a pyarrow Table, a pandas DataFrame or a dict of columns -> float32 [rows]

The columns are those the model trained on (``model.features.columns``: names in feature order and
the kind of each sparse column's ids; a model of a checkpoint written before that record: its
patterns such as ``int_*``, matched as training matched them), read exactly as training read them
(:mod:`apps.dlrm.serving.features`), the label and any other column ignored. Data that lacks one of
them (dropped, renamed) or holds a sparse column's ids as text where the model trained on integers
(or the other way) is refused, naming the column.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from torch import nn

from apps.core.urls import redact_urls
from apps.dlrm.serving.features import DEFAULT_BATCH_ROWS, Features, RowScorer
from apps.dlrm.serving.package import MANIFEST_FILE, PackageError, read_manifest, read_package
from apps.dlrm.serving.program import scorer
from apps.dlrm.serving.trained import NoCheckpoint, load_trained

#: How errors name the columns a model is given in memory.
GIVEN = "the columns given"


@dataclass
class Model:
    """A trained model, ready to score: its module (a package's program, or a checkpoint's model),
    what it reads, and where it comes from (a package's manifest; for a checkpoint its
    ``source``, ``features`` and training ``config`` as a package of it would record them)."""

    module: nn.Module
    features: Features
    manifest: dict[str, Any]

    @property
    def training_data_path(self) -> str:
        """The --data_path its training run read ("" for synthetic data)."""
        return self.manifest["training"]["config"].get("data_path", "")

    def __call__(self, columns: Any, batch_rows: int = DEFAULT_BATCH_ROWS) -> np.ndarray:
        """Click probabilities (float32, one per row) of the rows of ``columns``; none of none (an
        empty batch, whose columns' types may not even be known: an empty DataFrame's are null)."""
        table = as_table(columns)
        if table.num_rows == 0:
            return np.empty(0, dtype=np.float32)
        spec = self.features.spec([(GIVEN, table.schema)])
        rows = RowScorer(self.module, self.features, spec, batch_rows)
        return rows.score(rows.decode(table.select(spec.names), GIVEN))


def load_model(path: str, step: str = "best") -> Model:
    """The model of the inference package at ``path`` (any fsspec URL), or of the checkpoint
    that ``step`` (best, latest or a step number) names in the checkpoint folder ``path``."""
    return open_model(path, step, option="path")


def open_model(url: str, step: str, option: str) -> Model:
    """:func:`load_model`, errors naming ``option`` as what gave ``url``."""
    if read_manifest(url) is not None:
        package = read_package(url)
        return Model(package.module, Features.from_record(package.manifest["features"]), package.manifest)
    try:
        trained = load_trained(url, step, option)
    except NoCheckpoint:
        raise PackageError(
            f"{option} {redact_urls(url)} is neither an inference package (no {MANIFEST_FILE} of components.dlrm:export) "
            "nor a checkpoint folder (no committed step_NNNNNNNN checkpoint): give the --output of "
            "components.dlrm:export or the --checkpoint_dir of a training run"
        ) from None
    features = Features.of(trained.cfg, trained.columns)
    manifest = {
        "source": trained.source,
        "features": features.record(),
        "training": {"config": trained.checkpoint.manifest["config"]},
    }
    return Model(scorer(trained.model, trained.cfg.model), features, manifest)


def as_table(columns: Any) -> pa.Table:
    """``columns`` as a pyarrow Table: a Table or RecordBatch, a pandas DataFrame, or a mapping of
    names to columns (lists, numpy arrays, pyarrow arrays)."""
    if isinstance(columns, pa.Table):
        return columns
    if isinstance(columns, pa.RecordBatch):
        return pa.Table.from_batches([columns])
    if type(columns).__module__.startswith("pandas"):
        return pa.Table.from_pandas(columns, preserve_index=False)
    return pa.table(dict(columns))
