"""What a model reads of a row, and rows given as columns made into its program's inputs.

:class:`Features` is the input side of a trained model: which columns feed it (the training run's
``--dense_columns`` and ``--sparse_columns``, patterns matched in natural order as training
matched them), how a sparse value becomes a table row (``--categorical_ids``: hash or as_is) and
how dense values are read (``--dense_transform``: as they are, or log(1 + max(x, 0))). A model
trained on Criteo or synthetic data reads the columns that ``python -m apps.dlrm.preprocess
--output_format parquet`` writes (``int_0`` ..., ``cat_0`` ...), its ids as they are
(preprocessed ids are table rows).

:class:`RowScorer` scores rows decoded by the Parquet training reader's own decoder
(:class:`~apps.dlrm.data.parquet.read.RowDecoder`) in batches assembled by its own
:func:`~apps.dlrm.data.parquet.loader.assemble_batch`, so a row is scored exactly as it was read
for training and evaluation: a null, NaN or infinite dense value as 0, a null sparse value as no
id, a list column's elements as a multi-hot bag, hashed ids by SplitMix64 modulo the table.
"""

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import GOLDEN_GAMMA
from apps.dlrm.config import TrainConfig
from apps.dlrm.data.parquet.files import ColumnSpec, resolve_columns
from apps.dlrm.data.parquet.loader import assemble_batch
from apps.dlrm.data.parquet.read import RowDecoder, Rows
from apps.dlrm.model import feature_names
from apps.dlrm.serving.program import quiet_torch, score

#: The columns of models trained on Criteo or synthetic data: those of Criteo's Parquet days.
CRITEO_COLUMNS = (["int_*"], ["cat_*"])
#: Rows the program scores at once.
DEFAULT_BATCH_ROWS = 8192

_HASH = (
    "row = (SplitMix64 finaliser of (value + 0x{gamma:X}) mod 2**64, as an unsigned 64-bit integer) modulo the "
    "table's size; value: the column's integer as int64 (uint64 values by their bits), or for a text (string or "
    "bytes) column the FNV-1a 64 of the value's bytes (UTF-8; offset basis 0xCBF29CE484222325, prime "
    "0x100000001B3) by its bits; finaliser: x ^= x >> 30; "
    "x *= 0xBF58476D1CE4E5B9; x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31 (logical shifts, wrapping "
    "products); no seed beyond the constant. Reference: apps/core/common/hashing.py"
).format(gamma=GOLDEN_GAMMA)
_DENSE = {
    "parquet": "each dense column read as float32; null, NaN and infinite values as 0",
    "parquet_log1p": "each dense column read as float32; null, NaN and infinite values as 0; then "
    "log(1 + max(x, 0)) (--dense_transform log1p)",
    "criteo": "the preprocessed values: log(1 + max(x, 0)) of Criteo's integers, a missing one as 0 "
    "(apps/dlrm/data/criteo/convert.py); null, NaN and infinite values as 0",
    "synthetic": "as generated (standard normal); null, NaN and infinite values as 0",
}


@dataclass(frozen=True)
class Features:
    """The input side of a trained model (see the module docstring)."""

    data: str  #: what it trained on: parquet, criteo or synthetic
    dense_columns: list[str]
    sparse_columns: list[str]
    categorical_ids: str  #: hash or as_is
    table_sizes: list[int]
    num_dense_features: int
    dense_log1p: bool = False  #: dense values through log(1 + max(x, 0)) (--dense_transform log1p)

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Features":
        """The features of a model trained with ``cfg``; one whose ids scoring cannot make as
        training made them is refused: Criteo's multi-hot ids, derived from MLPerf's tables."""
        if cfg.data.data == "criteo" and cfg.model.multi_hot_sizes:
            raise ConfigError(
                "the model trained on --data criteo with --multi_hot_sizes, whose ids are derived from "
                "MLPerf's lookup tables as batches are made: exporting and scoring it is not supported; "
                "train on Parquet with list columns for a multi-hot model to serve"
            )
        parquet = cfg.data.data == "parquet"
        dense, sparse = (cfg.data.dense_columns, cfg.data.sparse_columns) if parquet else CRITEO_COLUMNS
        ids = cfg.data.categorical_ids if parquet else "as_is"
        log1p = cfg.data.dense_transform == "log1p"
        return cls(
            cfg.data.data, list(dense), list(sparse), ids, cfg.model.table_sizes, cfg.model.num_dense_features, log1p
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Features":
        """The features a package's manifest records (:meth:`record`); a package exported before
        ``--dense_transform`` existed records no ``dense_log1p``: its values were read as they are."""
        required = {name: record[name] for name in cls.__dataclass_fields__ if name != "dense_log1p"}
        return cls(**required, dense_log1p=record.get("dense_log1p", False))

    def record(self) -> dict[str, Any]:
        """The manifest's ``features``: these fields, the keys, and the transforms in words."""
        return {
            **{name: getattr(self, name) for name in self.__dataclass_fields__},
            "num_sparse_features": len(self.table_sizes),
            "keys": self.keys,
            "id_transform": _HASH
            if self.categorical_ids == "hash"
            else "as_is: the value is the table row, in [0, size)",
            "dense_transform": _DENSE[f"{self.data}_log1p" if self.dense_log1p else self.data],
        }

    @property
    def keys(self) -> list[str]:
        return feature_names(len(self.table_sizes))

    def with_columns(self, dense_columns: list[str], sparse_columns: list[str]) -> "Features":
        """These features read from other columns (given: not empty)."""
        return replace(
            self,
            dense_columns=dense_columns or self.dense_columns,
            sparse_columns=sparse_columns or self.sparse_columns,
        )

    def reading(self, data_path: str) -> TrainConfig:
        """The configuration of Parquet data at ``data_path`` that these features read: what the
        Parquet reader's checks and column matching take."""
        try:
            return TrainConfig.from_options(
                {
                    "data": "parquet",
                    "data_path": data_path,
                    "dense_columns": self.dense_columns,
                    "sparse_columns": self.sparse_columns,
                    "categorical_ids": self.categorical_ids,
                    "dense_transform": "log1p" if self.dense_log1p else "none",
                    "num_dense_features": self.num_dense_features,
                    "num_sparse_features": len(self.table_sizes),
                    "num_embeddings_per_feature": self.table_sizes,
                }
            )
        except ConfigError as e:
            raise ConfigError(
                f"{e} (the model reads {self.num_dense_features} dense and {len(self.table_sizes)} sparse features)"
            ) from None

    def spec(self, schemas: list[tuple[str, pa.Schema]]) -> ColumnSpec:
        """The columns of ``schemas`` (named by where they come from) that feed the model."""
        return resolve_columns(self.reading(schemas[0][0]), schemas, labelled=False)


class RowScorer:
    """Scores rows of the columns of ``spec`` with ``module`` (a program or an eager Scorer)."""

    def __init__(
        self, module: nn.Module, features: Features, spec: ColumnSpec, batch_rows: int = DEFAULT_BATCH_ROWS
    ) -> None:
        self.module = module
        self.features = features
        self.batch_rows = batch_rows
        self.decoder = RowDecoder(
            spec, features.table_sizes, features.categorical_ids, np.dtype(np.int64), features.dense_log1p
        )

    def decode(self, table: pa.Table, source: str, group: int = 0) -> Rows:
        """The rows of ``table`` (of ``source``'s row group ``group``, as errors name them)."""
        return self.decoder.decode(table, lambda row: (source, group))

    @torch.no_grad()
    def score(self, rows: Rows) -> np.ndarray:
        """float32 probabilities of ``rows``, ``batch_rows`` at a time."""
        scores = np.empty(len(rows), dtype=np.float32)
        keys, num_dense = self.features.keys, self.features.num_dense_features
        with quiet_torch():  # a program's first call warns of fx tracing
            for lo in range(0, len(rows), self.batch_rows):
                hi = min(lo + self.batch_rows, len(rows))
                batch = assemble_batch([(rows, np.array([[lo, hi]]))], keys, num_dense, torch.int64)
                sparse = batch.sparse_features
                scores[lo:hi] = score(self.module, batch.dense_features, sparse.values(), sparse.lengths()).numpy()
        return scores
