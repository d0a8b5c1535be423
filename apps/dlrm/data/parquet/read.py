"""Fetching row groups of Parquet files and decoding them into the arrays batches are cut from.

Fetching. Row groups are read by pyarrow through its own filesystem for the files' URL
(:mod:`apps.dlrm.data.parquet.filesystems`), the footers already read at start-up given to it,
the needed column chunks of a row group fetched in a few concurrent ranged reads (``pre_buffer``).
Only the columns training reads travel, and nothing but the row groups of this rank's share: a
data set is never copied whole to any host. A row group whose
pages do not decode (a file damaged after its footer was written) stops training with an error
naming the file and the row group.

Files need not agree on a column's exact type: one file's ``int32`` ids beside another's
``int64``, ``float`` beside ``double``, a non-nullable column beside a nullable one (Spark's and
BigQuery's exports differ so) are read as one. Rows of files whose types differ are cast, per column
chunk, to one type per column (:func:`_common_schema`) before they are put together; the cast is the
one decoding makes anyway, so a row reads the same whichever rows it is read with.

Decoding (:class:`Rows`), vectorised per column (numpy and pyarrow compute, no loop over rows):

- the label and dense columns become float32 (a decimal through float64); a null dense value is
  0, a null label or one other than 0 and 1 an error
  (:func:`apps.dlrm.data.parquet.files.null_label_error`, ``check_label``); rows read to be
  scored (a spec without a label column) have NaN labels;
- a NaN or infinite dense value is 0 too, as a null is (it would train the model to NaN): counted
  per column as read (:attr:`RowGroupReader.nonfinite`), a column's first ones logged naming the
  file and row group. Statistics cannot count them (they leave NaN out), so they are found on the
  decoded block, at the cost of one sum per feature when there are none;
- with ``--dense_transform log1p`` the dense values then become log(1 + max(x, 0)), in place;
- a sparse column becomes ids: an integer column without nulls one id per row, written chunk by
  chunk into one array of every such column's ids; an integer column with nulls (none for a
  null) and a list column (its elements, nulls in a list dropped, a null list empty) its ids with
  per-row offsets, as a KeyedJaggedTensor holds them; ``hash`` ids are SplitMix64 of the value
  (:func:`apps.core.common.hashing.mix64`, its int64 bits) modulo the table size, a text value's
  value being the FNV-1a 64 of its bytes (UTF-8 for strings: :func:`apps.core.common.hashing.text_fingerprints`);
  ``as_is`` ids must lie in the table (:func:`apps.dlrm.data.parquet.files.check_id`); ``zch``
  ids are hashed as ``hash`` ids are, modulo TorchRec's managed-collision input range instead of
  the table size (:func:`id_ranges`), for its module to map to rows; so are those of the columns
  ``--zch_columns`` names, the other columns' as ``--categorical_ids`` says.

Nothing read from a file is executed or unpickled: Parquet pages are decoded by pyarrow into
numbers, and only numbers reach training.
"""

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import hashed_ids, id_values
from apps.core.zch.config import INPUT_HASH_SIZE, ZCH
from apps.dlrm.data.parquet.files import (
    ColumnSpec,
    DataFile,
    check_id,
    check_label,
    null_label_error,
)
from apps.dlrm.data.parquet.filesystems import arrow_filesystem
from apps.dlrm.data.parquet.order import Piece
from apps.dlrm.data.parquet.pool import ArrayPool

logger = logging.getLogger("apps.dlrm.data")


@dataclass
class Ragged:
    """A sparse feature's ids where rows hold none or several (a list column, or nulls)."""

    ids: np.ndarray  # row after row
    offsets: np.ndarray  # int64 [n + 1]: row i's ids are ids[offsets[i]:offsets[i + 1]]
    lengths: np.ndarray  # int32 [n]: how many ids each row holds, as a batch's lengths hold them


@dataclass
class Rows:
    """Decoded rows: dense features, labels, and each sparse feature's ids. Their arrays may be
    memory of an :class:`~apps.dlrm.data.parquet.pool.ArrayPool`, reused once the Rows are gone:
    whatever reads them holds the Rows, not only its arrays."""

    # float32 [dense features, n]: feature-major, as columns decode (contiguous writes); a batch
    # copies its runs of rows so and transposes only its own (see assemble_batch), in cache.
    dense: np.ndarray
    labels: np.ndarray  # float32 [n]
    # [sparse features, n]: feature f's ids, one per row, where ragged[f] is None (an integer
    # column without nulls, the common case): one array, so that a batch copies a run of rows'
    # ids of all such features in one call (its values hold them feature after feature, too).
    ids: np.ndarray
    ragged: list[Ragged | None]  # per sparse feature, its ids where rows hold none or several

    def __len__(self) -> int:
        return self.labels.shape[0]


class RowGroupReader:
    """Reads pieces of row groups into :class:`Rows`: only the columns of ``spec``, decoded by
    ``decoder``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, files: list[DataFile], decoder: "RowDecoder") -> None:
        self._arrow_fs = arrow_filesystem(fs, files[0].path)
        self.files = files
        self.decoder = decoder
        self.spec = decoder.spec
        self._cached: tuple[tuple[int, int], Rows] | None = None
        self._pool = ArrayPool()

    @property
    def nonfinite(self) -> dict[str, int]:
        """NaN or infinite values read (and made 0) per dense column, by every thread that reads."""
        return self.decoder.nonfinite

    def read(self, pieces: list[Piece]) -> Rows:
        """The rows of ``pieces``, in their order; their row groups are fetched at once."""
        groups = sorted({(f, g) for f, g, _, _ in pieces})
        tables = self._read_groups(groups)
        return self._decode(pieces, _concat([tables[f, g].slice(lo, hi - lo) for f, g, lo, hi in pieces], self.spec))

    def group(self, f: int, g: int) -> Rows:
        """Row group ``g`` of file ``f``, whole; the last one asked for is kept, so that reading a
        split in order, batch after batch, fetches each row group once."""
        if self._cached is None or self._cached[0] != (f, g):
            self._cached = (f, g), self.read([(f, g, 0, self.files[f].metadata.row_group(g).num_rows)])
        return self._cached[1]

    def _read_groups(self, groups: list[tuple[int, int]]) -> dict[tuple[int, int], pa.Table]:
        tables = {}
        for f in sorted({f for f, _ in groups}):
            with self._arrow_fs.open_input_file(self.files[f].path) as source:
                # pre_buffer: the needed column chunks of a row group are fetched in a few
                # concurrent ranged reads (adjacent ones merged), not page by page.
                reader = pq.ParquetFile(source, metadata=self.files[f].metadata, pre_buffer=True)
                tables.update({(f, g): self._decoded_group(reader, f, g) for ff, g in groups if ff == f})
        return tables

    def _decoded_group(self, reader: pq.ParquetFile, f: int, g: int) -> pa.Table:
        """Row group ``g`` of file ``f``, its columns of ``spec``; a page that does not decode
        (torn or corrupted after its footer was written) is an error naming file and row group."""
        try:
            return reader.read_row_group(g, columns=self.spec.names).select(self.spec.names)
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(
                f"{self.files[f].url}: row group {g} cannot be decoded ({' '.join(str(e).split())}): the file is "
                "corrupt, or was rewritten since the job started; write it again, or leave it out of --data_path"
            ) from e

    def _decode(self, pieces: list[Piece], table: pa.Table) -> Rows:
        """The rows of ``table``, which holds those of ``pieces``; an error names the piece's file."""
        starts = np.cumsum([0] + [hi - lo for _, _, lo, hi in pieces])

        def where(row: int) -> tuple[str, int]:  # the file and row group of one of the table's rows
            f, g, _, _ = pieces[int(np.searchsorted(starts, row, side="right")) - 1]
            return self.files[f].url, g

        return self.decoder.decode(table, where, self._pool)


#: What becomes of NaN and infinite dense values, as the warning of their first says: in rows read
#: to train, or to score (a spec without a label).
_NONFINITE_FATE = {
    "trained": "they train as 0, as nulls do; their count is logged when training ends",
    "scored": "they are scored as 0, as nulls are; predict counts them in its report.json",
}


class RowDecoder:
    """Decodes tables of the columns of ``spec`` into :class:`Rows` (see the module docstring): ids
    made as ``categorical_ids`` says for tables of ``table_sizes`` (those of the features ``managed``
    as ``zch`` makes them), as ``id_dtype``; dense values through log(1 + max(x, 0)) where
    ``log1p``. Training's reader decodes the row groups it fetches with one, and scoring the tables
    it is given."""

    def __init__(
        self,
        spec: ColumnSpec,
        table_sizes: list[int],
        categorical_ids: str,
        id_dtype: np.dtype,
        log1p: bool,
        managed: Sequence[int] = (),
    ) -> None:
        self.spec = spec
        self.id_ranges = id_ranges(categorical_ids, table_sizes, managed)
        hashed = categorical_ids in ("hash", ZCH)
        self.hash_ids = [hashed or k in managed for k in range(len(table_sizes))]  # per feature
        self.id_dtype = id_dtype
        self.log1p = log1p
        #: NaN or infinite values read (and made 0) per dense column, by every thread that reads.
        self.nonfinite: dict[str, int] = {}
        self._nonfinite_lock = threading.Lock()

    def decode(self, table: pa.Table, where: Callable[[int], tuple[str, int]], pool: ArrayPool | None = None) -> Rows:
        """The rows of ``table`` (the spec's columns, in any order); ``where(row)`` says which file
        and row group a row comes from, for errors. Scoring decodes tables it holds this way too,
        so that a model scores rows exactly as it trained on them. Their arrays are written into
        memory of ``pool`` (None: fresh), lent to the rows until they are gone."""
        spec = self.spec
        # Dense features column after column into a feature-major array: contiguous writes, 4x
        # faster than into a row-major array's strided columns.
        shapes = [(len(spec.sparse), self.id_dtype), (len(spec.dense), np.dtype(np.float32)), (1, np.dtype(np.float32))]
        if pool is None:
            ids, dense, labels = (np.empty((count, table.num_rows), dtype=dtype) for count, dtype in shapes)
        else:
            memory, (ids, dense, labels) = pool.arrays(table.num_rows, shapes)
        for j, name in enumerate(spec.dense):
            _floats_into(table.column(name), dense[j])
        with np.errstate(over="ignore", invalid="ignore"):  # a sum is finite only if every value is
            all_finite = np.isfinite(dense.sum(axis=1)).all()
        if not all_finite:
            self._zero_nonfinite(dense, where)
        if self.log1p:
            np.log1p(np.maximum(dense, 0, out=dense), out=dense)
        ragged: list[Ragged | None] = []
        for f, (name, multi_hot, size) in enumerate(zip(spec.sparse, spec.multi_hot, self.id_ranges)):
            column = table.column(name)
            if multi_hot or column.null_count:
                values, offsets = _ragged(column.combine_chunks(), multi_hot)
                checked = self._ids(values, f, size, name, offsets, where).astype(self.id_dtype, copy=False)
                ragged.append(Ragged(checked, offsets, np.diff(offsets).astype(np.int32)))
                continue
            # One id per row: chunk after chunk straight into the rows' ids (no combined copy first).
            at = 0
            for chunk in column.chunks:
                values = id_values(chunk)
                ids[f, at : at + len(values)] = self._ids(values, f, size, name, None, _after(where, at))
                at += len(values)
            ragged.append(None)
        self._labels(table, where, labels[0])
        rows = Rows(dense, labels[0], ids, ragged)
        if pool is not None:
            pool.lend(rows, memory)
        return rows

    def _labels(self, table: pa.Table, where: Callable[[int], tuple[str, int]], values: np.ndarray) -> None:
        """Writes the labels of ``table``'s rows into ``values``, checked (0 or 1, none null); NaN
        for rows read to be scored (a spec without a label column)."""
        label = self.spec.label
        if label is None:
            values[:] = np.nan
            return
        column = table.column(label)
        if column.null_count:
            url, g = where(int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0]))
            raise null_label_error(url, label, g, column.null_count)
        _floats_into(column, values)
        unlabelled = (values != 0) & (values != 1)  # NaN too
        if unlabelled.any():
            k = int(np.flatnonzero(unlabelled)[0])
            url, g = where(k)
            check_label(float(values[k]), url, label, g)

    def _zero_nonfinite(self, dense: np.ndarray, where: Callable[[int], tuple[str, int]]) -> None:
        """Makes the NaN and infinite values of ``dense`` [features, rows] 0, as nulls are, and
        counts them; a column's first ones are logged, naming their file and row group."""
        bad = ~np.isfinite(dense)
        dense[bad] = 0
        counts = bad.sum(axis=1)
        with self._nonfinite_lock:
            for j in np.flatnonzero(counts):
                name = self.spec.dense[j]
                if name not in self.nonfinite:
                    url, g = where(int(np.argmax(bad[j])))
                    logger.warning(
                        "%s: dense column %r holds NaN or infinite values (row group %d): %s (fix them where the "
                        "files are written)",
                        url,
                        name,
                        g,
                        _NONFINITE_FATE["scored" if self.spec.label is None else "trained"],
                    )
                self.nonfinite[name] = self.nonfinite.get(name, 0) + int(counts[j])

    def _ids(
        self,
        values: np.ndarray,
        feature: int,
        size: int,
        column: str,
        offsets: np.ndarray | None,
        where: Callable[[int], tuple[str, int]],
    ) -> np.ndarray:
        """The embedding rows of a column's ``values`` (see the module docstring), the ids of sparse
        ``feature``, in [0, size): any integer type, that the caller casts to ``id_dtype`` as it
        copies them."""
        if self.hash_ids[feature]:
            return hashed_ids(values, size)
        # One pass, not a minimum and a maximum: read as unsigned, a negative id is larger than any table.
        if len(values) and values.view(f"u{values.itemsize}").max() >= size:
            k = int(np.flatnonzero((values < 0) | (values >= size))[0])
            url, g = where(k if offsets is None else int(np.searchsorted(offsets, k, side="right")) - 1)
            check_id(int(values[k]), size, url, column, g)
        return values


def id_ranges(categorical_ids: str, table_sizes: list[int], managed: Sequence[int] = ()) -> list[int]:
    """The range each feature's ids are made in: its table's rows, or with ``zch`` (every feature's,
    or those ``managed``) the input range of TorchRec's managed-collision module (apps/core/zch/),
    which maps them to rows."""
    every = categorical_ids == ZCH
    return [INPUT_HASH_SIZE if every or k in managed else size for k, size in enumerate(table_sizes)]


def _common_schema(spec: ColumnSpec) -> pa.Schema:
    """One type per column, that any file's type of it casts to: float32 for the label and dense
    features (what decoding makes of them: a large integer rounds as decoding rounds it), int64 ids
    or lists of them (uint64 ids keep their bits, which is what hashing reads), text as bytes."""
    elements = [pa.large_binary() if text else pa.int64() for text in spec.text]
    ids = [pa.list_(element) if multi_hot else element for element, multi_hot in zip(elements, spec.multi_hot)]
    types = [pa.float32()] * (len(spec.names) - len(ids)) + ids
    return pa.schema([pa.field(name, t) for name, t in zip(spec.names, types)])


def _concat(tables: list[pa.Table], spec: ColumnSpec) -> pa.Table:
    """``tables`` (of ``spec.names``) as one; cast to :func:`_common_schema` only where their
    types differ, so that files that agree (the common case) are not copied."""
    first = tables[0].schema
    if all(table.schema.equals(first) for table in tables[1:]):
        return pa.concat_tables(tables)
    schema = _common_schema(spec)
    return pa.concat_tables([_decimals_as_doubles(table).cast(schema, safe=False) for table in tables])


def _decimals_as_doubles(table: pa.Table) -> pa.Table:
    """``table`` with its decimal columns as float64, which casts to float32 exactly as a double
    does: pyarrow casts a decimal straight to float32 in float32 arithmetic (-360.000 became
    -360.00003)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_decimal(field.type):
            table = table.set_column(i, field.name, table.column(i).cast(pa.float64()))
    return table


def _after(where: Callable[[int], tuple[str, int]], at: int) -> Callable[[int], tuple[str, int]]:
    """``where`` for rows counted from row ``at`` (a column chunk's)."""
    return lambda k: where(at + k)


def _floats_into(column: pa.ChunkedArray, out: np.ndarray) -> None:
    """Writes a numeric column into ``out`` as float32, nulls as 0 (a large integer rounds, as
    float32 must round it: hence the unsafe cast)."""
    at = 0
    for chunk in column.chunks:
        # Each step only where it changes something: each would be a pass over a fresh copy.
        if pa.types.is_decimal(chunk.type):  # via a double: see _decimals_as_doubles
            chunk = chunk.cast(pa.float64())
        values = chunk if chunk.type == pa.float32() else chunk.cast(pa.float32(), safe=False)
        if values.null_count:
            values = pc.fill_null(values, 0.0)
        out[at : at + len(values)] = values.to_numpy()
        at += len(values)


def _ragged(column: pa.Array, multi_hot: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets [n + 1]) of a list column, or of a column with nulls; a null holds no id."""
    n = len(column)
    values = pc.list_flatten(column) if multi_hot else column
    rows = pc.list_parent_indices(column).to_numpy() if multi_hot else np.arange(n)
    if values.null_count:
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        values, rows = values.filter(pa.array(valid)), rows[valid]
    return id_values(values), np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
