"""What a model reads of a row, and rows given as columns made into its program's inputs.

:class:`Features` is the input side of a trained model: which columns feed it (the training run's
``--dense_columns`` and ``--sparse_columns``, patterns matched in natural order as training
matched them), how a sparse value becomes a table row (``--categorical_ids``: hash or as_is) and
how dense values are read (``--dense_transform``: as they are, or log(1 + max(x, 0))). A model
trained on Criteo or synthetic data reads the columns that ``python -m apps.dlrm.preprocess
--output_format parquet`` writes (``int_0`` ..., ``cat_0`` ...), its ids as they are
(preprocessed ids are table rows).

A model trained on Parquet records the columns its patterns matched (``columns``: names in feature
order, each sparse column's ids integer or text): data to score must hold every one of them under
its name, sparse ids of the same kind (a hashed integer and a hashed text are other rows; a list
where the model read single ids is a bag it never saw), or it is refused, naming the column;
other columns are ignored. A checkpoint written before the record
matches the patterns against the data, as its training did.

:class:`RowScorer` scores rows decoded by the Parquet training reader's own decoder
(:class:`~apps.dlrm.data.parquet.read.RowDecoder`) in batches assembled by its own
:func:`~apps.dlrm.data.parquet.loader.assemble_batch`, so a row is scored exactly as it was read
for training and evaluation: a null, NaN or infinite dense value as 0, a null sparse value as no
id, a list column's elements as a multi-hot bag, hashed ids by SplitMix64 modulo the table.
"""

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import GOLDEN_GAMMA
from apps.dlrm.config import JobConfig
from apps.dlrm.data.parquet.files import ColumnSpec, column_listing, match_columns, resolve_columns
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
#: How a zch model's ids are made: the hash into TorchRec's managed-collision input range, which the
#: program itself maps to rows (apps/core/zch/).
_ZCH = (
    "id = "
    + _HASH.replace("modulo the table's size", "modulo 2**63 - 1").removeprefix("row = ")
    + ". The program maps "
    "each id to its row with the managed-collision tables' id maps it holds (TorchRec's MCH remap); an id "
    "without a row (never seen, or evicted) is looked up in the tables' last row, which such ids shared in training"
)
_ID_TRANSFORMS = {"hash": _HASH, "zch": _ZCH, "as_is": "as_is: the value is the table row, in [0, size)"}
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
    categorical_ids: str  #: hash, zch or as_is
    table_sizes: list[int]
    num_dense_features: int
    dense_log1p: bool = False  #: dense values through log(1 + max(x, 0)) (--dense_transform log1p)
    #: The columns the patterns matched in training (:meth:`ColumnSpec.record`); None where the
    #: options fix them (Criteo, synthetic) or the checkpoint predates the record.
    columns: ColumnSpec | None = None
    #: The features (0-based) whose ids are made as ``zch`` makes them beside ``categorical_ids``
    #: (--zch_columns); a package exported before it records none.
    zch_features: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: JobConfig, columns: dict[str, Any] | None = None) -> "Features":
        """The features of a model trained with ``cfg`` on ``columns`` (what its checkpoint
        records of them, if anything); one whose ids scoring cannot make as training made them is
        refused: Criteo's multi-hot ids, derived from MLPerf's tables."""
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
            cfg.data.data,
            list(dense),
            list(sparse),
            ids,
            cfg.model.table_sizes,
            cfg.model.num_dense_features,
            log1p,
            ColumnSpec.from_record(columns) if columns else None,
            cfg.zch_features if parquet and ids != "zch" else [],
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Features":
        """The features a package's manifest records (:meth:`record`); a package exported before
        ``--dense_transform`` existed records no ``dense_log1p`` (its values were read as they
        are), one exported before the columns were recorded no ``columns``."""
        optional = ("dense_log1p", "columns", "zch_features")
        required = {name: record[name] for name in cls.__dataclass_fields__ if name not in optional}
        columns = record.get("columns")
        return cls(
            **required,
            dense_log1p=record.get("dense_log1p", False),
            columns=ColumnSpec.from_record(columns) if columns else None,
            zch_features=record.get("zch_features", []),
        )

    def record(self) -> dict[str, Any]:
        """The manifest's ``features``: these fields, the keys, and the transforms in words."""
        return {
            **{name: getattr(self, name) for name in self.__dataclass_fields__ if name != "columns"},
            "columns": self.columns.record() if self.columns is not None else None,
            "num_sparse_features": len(self.table_sizes),
            "keys": self.keys,
            "id_transform": self._id_transform(),
            "dense_transform": _DENSE[f"{self.data}_log1p" if self.dense_log1p else self.data],
        }

    def _id_transform(self) -> str:
        """How a sparse value becomes the model's id, in words: the features' ``zch_features`` apart."""
        words = _ID_TRANSFORMS[self.categorical_ids]
        if not self.zch_features:
            return words
        managed = ", ".join(self.keys[k] for k in self.zch_features)
        return f"{managed} (--zch_columns): {_ID_TRANSFORMS['zch']}; the others: {words}"

    @property
    def keys(self) -> list[str]:
        return feature_names(len(self.table_sizes))

    def reading(self, data_path: str, dense: list[str], sparse: list[str]) -> JobConfig:
        """The configuration of Parquet data at ``data_path`` whose columns ``dense`` and
        ``sparse`` these features read: what the Parquet reader's checks take."""
        try:
            return JobConfig.from_options(
                {
                    "data": "parquet",
                    "data_path": data_path,
                    "dense_columns": dense,
                    "sparse_columns": sparse,
                    "categorical_ids": self.categorical_ids,
                    "zch_columns": [sparse[k] for k in self.zch_features],
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

    def spec(
        self,
        schemas: list[tuple[str, pa.Schema]],
        dense_columns: Sequence[str] = (),
        sparse_columns: Sequence[str] = (),
    ) -> ColumnSpec:
        """The columns of ``schemas`` (named by where they come from) that feed the model: those
        it trained on, or those that ``dense_columns`` / ``sparse_columns`` (prediction's options:
        patterns, matched in the first schema) name instead. Refused in one line naming the column
        and the fix: a column the model trained on that a schema lacks (dropped or renamed), and a
        sparse column whose ids are of another kind (integer or text, a list for single ids) than
        the model trained on."""
        url, first = schemas[0]
        dense = self._names("dense", dense_columns, url, first)
        sparse = self._names("sparse", sparse_columns, url, first)
        trained = {"dense": [] if dense_columns else dense, "sparse": [] if sparse_columns else sparse}
        for where, schema in schemas:
            _check_trained_columns(trained, [*dense, *sparse], where, schema)
        reading = self.reading(url, dense, sparse)
        spec = resolve_columns(reading.model, reading.data, schemas, labelled=False)
        if self.columns is not None:
            _check_id_kinds(spec, self.columns, url)
        return spec

    def _names(self, group: str, given: Sequence[str], url: str, schema: pa.Schema) -> list[str]:
        """The ``group`` (dense or sparse) columns to read: those that ``given`` matches in
        ``schema`` (of ``url``), else those the model trained on (recorded, or its patterns matched)."""
        if not given and self.columns is not None:
            return getattr(self.columns, group)
        patterns = list(given) or getattr(self, f"{group}_columns")
        names = match_columns(patterns, schema.names, f"{group}_columns", url)
        count = self.num_dense_features if group == "dense" else len(self.table_sizes)
        if len(names) != count:
            fix = (
                f"name {count} columns"
                if given
                else "the data lacks a column the model trained on, or its pattern matches one more (this model "
                "predates the record of its columns, so which is not known); give the data the columns it trained "
                f"on, named as then (predict can instead name {count} columns by --{group}_columns)"
            )
            whose = "" if given else "the model's "
            raise ConfigError(
                f"{whose}--{group}_columns {','.join(patterns)} matches {len(names)} columns of {url} "
                f"({column_listing(names)}), but the model reads {count} {group} features: {fix}"
            )
        return names


def _check_trained_columns(trained: dict[str, list[str]], read: list[str], url: str, schema: pa.Schema) -> None:
    """Refuses a ``schema`` (of ``url``) without a column of ``trained`` (per group, the columns
    the model trained on that it reads), naming the columns it holds that the model does not
    read (``read``): among them, most likely, the one renamed."""
    for group, names in trained.items():
        for k, name in enumerate(names):
            if name not in schema.names:
                others = [column for column in schema.names if column not in read]
                raise ConfigError(
                    f"{url} has no column {name!r}, which the model trained on as {group} feature {k + 1} of "
                    f"{len(names)} ({column_listing(names)}); its columns the model does not read: "
                    f"{column_listing(others) or 'none'}: rename the column that holds it to {name!r} (or add it); "
                    "columns the model does not read are ignored"
                )


#: How to make a column's ids of each kind, in SQL: what the training data held.
_CAST = {True: ("text", "STRING"), False: ("integers", "BIGINT")}


def _check_id_kinds(spec: ColumnSpec, trained: ColumnSpec, url: str) -> None:
    """Refuses a sparse column of ``spec`` (of ``url``) whose ids are text where the model's
    column (``trained``, feature for feature) held integers, or the other way: hashed, a value
    as text and as an integer are other rows, and the model would score ids it never learned.
    So is a list column where the model's held single ids: a bag of several ids pools rows into
    an input the model never saw (single ids where it trained lists are bags of one, which it did)."""
    for k, (name, text, multi_hot, trained_name, trained_text, trained_multi_hot) in enumerate(
        zip(spec.sparse, spec.text, spec.multi_hot, trained.sparse, trained.text, trained.multi_hot)
    ):
        if multi_hot and not trained_multi_hot:
            raise ConfigError(
                f"{url}: sparse column {name!r} holds lists of ids, but the model trained on single ids there "
                f"(sparse feature {k + 1}, column {trained_name!r}): a list is scored as the bag of its ids, an "
                "input the model never learned; give the column of one id per row that training read"
            )
        if text != trained_text:
            held, (wanted, sql) = _CAST[text][0], _CAST[trained_text]
            raise ConfigError(
                f"{url}: sparse column {name!r} holds {held}, but the model trained on {wanted} there (sparse "
                f"feature {k + 1}, column {trained_name!r}): a value hashes to other table rows as {held} than as "
                f"{wanted}, rows the model never learned; cast the column to {wanted}, holding the values training "
                f"read (e.g. CAST({name} AS {sql}) where the data is written)"
            )


class RowScorer:
    """Scores rows of the columns of ``spec`` with ``module`` (a program or an eager Scorer)."""

    def __init__(
        self, module: nn.Module, features: Features, spec: ColumnSpec, batch_rows: int = DEFAULT_BATCH_ROWS
    ) -> None:
        self.module = module
        self.features = features
        self.batch_rows = batch_rows
        self.decoder = RowDecoder(
            spec,
            features.table_sizes,
            features.categorical_ids,
            np.dtype(np.int64),
            features.dense_log1p,
            features.zch_features,
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
