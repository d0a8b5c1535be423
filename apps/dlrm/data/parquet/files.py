"""The Parquet files of ``--data_path``, and every check that their footers allow before training.

Every rank reads every file's footer (its last bytes: from an object store one ranged GET per
file, all issued at once) and so knows the row count of every row group, which is all that the
split into ranks needs (:mod:`apps.dlrm.data.parquet.order`); no data page is read at start-up. The
footers also let the job refuse, before its first step, what would otherwise fail hours in or
train on garbage. Each error is one line naming the file, the column and the fix:

- a file that is not Parquet, or none at all under --data_path; a symlink to nothing or to a folder
  (symlinks to files are followed);
- a column named by --label_column, --dense_columns or --sparse_columns that a file lacks, or of
  a type we do not read: numbers (integer, float, decimal, boolean) for the label and dense features,
  integers, text (strings or bytes, with ``--categorical_ids hash``) or lists of them for sparse
  ones;
- a null label: such a row cannot train (drop or fill it upstream); a label other than 0 or 1,
  which trains to a negative loss;
- with ``--categorical_ids as_is``, an id outside its embedding table;

the last three from the statistics that Parquet writers record per column chunk (Spark, BigQuery's
exports and pyarrow do by default). For a file without them the same checks run as its rows are
read (:mod:`apps.dlrm.data.parquet.read`), and stop training with the same message; so do the labels
that statistics cannot show (0.5 between a chunk's minimum 0 and maximum 1; NaN, which they leave out).

Scale: the same statistics give each dense column's range (:func:`dense_ranges`). The loader
warns of columns that reach beyond :data:`UNSCALED_DENSE` (raw counts, prices, durations), unless
``--dense_transform log1p`` takes their logarithm; and with it, of columns that hold negative
values, which log1p's clip makes 0 (columns already scaled).

Null counts: a null dense value trains as 0, a null sparse value as an empty bag (no id). Their
counts per column, summed from the same statistics, are logged at start-up as the Criteo
preprocessing reports its repaired rows. A list column's statistics cannot tell a null list from
an empty one (Parquet stores neither as a value), so list columns are not counted: both are empty
bags anyway.
"""

import fnmatch
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from apps.core.common.errors import ConfigError
from apps.core.common.splits import Range, held_out_split
from apps.core.urls import is_url, reaching
from apps.core.zch.config import ZCH
from apps.dlrm.config import DataConfig, ModelConfig, is_pattern, zch_features
from apps.dlrm.data.criteo.sources import natural_key
from apps.dlrm.data.trained import TrainedColumns

SUFFIXES = (".parquet", ".parq")
#: Bytes read from a file's end for its footer in the first request; a larger footer takes a second.
FOOTER_GUESS = 1 << 16
_MAGIC = b"PAR1"
_ENCRYPTED_MAGIC = b"PARE"
_TAIL = 8  # the footer's length (4 bytes, little-endian) and the magic
#: A dense value beyond this magnitude is unscaled: the MLPs' first layer turns it into activations
#: that saturate the loss (a column of 1e20 counts trained to losses of 1e15 and AUROC 0.47).
UNSCALED_DENSE = 1000.0


@dataclass(frozen=True)
class DataFile:
    """One Parquet file and its footer."""

    url: str  # what messages name: the URL for remote files, else the path
    path: str  # what the filesystem opens
    size: int  # bytes
    metadata: pq.FileMetaData

    @property
    def rows(self) -> int:
        return self.metadata.num_rows

    def group_rows(self) -> list[int]:
        return [self.metadata.row_group(g).num_rows for g in range(self.metadata.num_row_groups)]


@dataclass(frozen=True)
class ColumnSpec:
    """The columns training (or prediction, without a label) reads, matched against the files."""

    label: str | None  # None: the rows are read to be scored, not to train
    dense: list[str]
    sparse: list[str]
    multi_hot: list[bool]  # per sparse column: a list column (several ids per sample)
    text: list[bool]  # per sparse column: its values (or list elements) are strings or bytes, hashed

    @property
    def names(self) -> list[str]:
        return [*([self.label] if self.label is not None else []), *self.dense, *self.sparse]

    def record(self) -> dict[str, Any]:
        """The feature columns as a checkpoint's and a package's manifests record them (JSON), in
        feature order: the dense columns' names and, per sparse column, its name, its ids
        (``integer`` or ``text``) and whether it is a ``list``. What a model trained on: scoring
        checks the data against it (a pattern alone cannot tell a renamed or retyped column)."""
        return {
            "dense": self.dense,
            "sparse": [
                {"name": name, "ids": "text" if text else "integer", "list": multi_hot}
                for name, text, multi_hot in zip(self.sparse, self.text, self.multi_hot)
            ],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "ColumnSpec":
        """The columns of :meth:`record` (without a label)."""
        sparse = record["sparse"]
        return cls(
            None,
            list(record["dense"]),
            [column["name"] for column in sparse],
            [column["list"] for column in sparse],
            [column["ids"] == "text" for column in sparse],
        )

    def ordered_as(self, trained: "ColumnSpec", checkpoint: str) -> "ColumnSpec":
        """These columns (matched from the options) in the feature order of ``trained``, the
        columns the model of ``checkpoint`` trained on (its manifest's record): a model's feature
        k is the k-th column it trained on, so the same columns listed in another order must feed
        it by name, not by place. Refused in one line: other columns than it trained on, or a
        sparse column whose ids are of another kind (a list for single ids, text for integers)."""
        for group in ("dense", "sparse"):
            given, wanted = getattr(self, group), getattr(trained, group)
            if sorted(given) != sorted(wanted):
                other = [name for name in given if name not in wanted]
                lacking = [name for name in wanted if name not in given]
                raise ConfigError(
                    f"the model of {checkpoint} trained on the {group} columns {column_listing(wanted)}, but "
                    f"--{group}_columns {column_listing(given)} name other ones (not trained on: "
                    f"{column_listing(other) or 'none'}; not named: {column_listing(lacking) or 'none'}): give the "
                    f"columns it trained on (in any order), or a new --checkpoint_dir to train on these"
                )
        at = {name: k for k, name in enumerate(self.sparse)}
        order = [at[name] for name in trained.sparse]
        spec = ColumnSpec(
            self.label,
            list(trained.dense),
            list(trained.sparse),
            [self.multi_hot[k] for k in order],
            [self.text[k] for k in order],
        )
        for k, (read, then) in enumerate(zip(spec.record()["sparse"], trained.record()["sparse"])):
            if read != then:
                raise ConfigError(
                    f"sparse column {read['name']!r} holds {_id_kind(read)} here, but the model of {checkpoint} "
                    f"trained on {_id_kind(then)} there (sparse feature {k + 1}): ids of another kind are other "
                    "table rows; give the column the type it had in training (e.g. CAST where the files are written)"
                )
        return spec


def _id_kind(column: dict[str, Any]) -> str:
    """A sparse column's record (:meth:`ColumnSpec.record`) in words: "lists of text ids"."""
    ids = f"{column['ids']} ids"
    return f"lists of {ids}" if column["list"] else f"single {ids}"


def open_files(data_path: str, first_only: bool = False) -> tuple[fsspec.AbstractFileSystem, list[DataFile]]:
    """The filesystem and the Parquet files of ``data_path``, in natural name order, footers read
    (``first_only``: the first file's alone)."""
    fs, root = fsspec.core.url_to_fs(data_path)
    try:
        with reaching("--data_path", data_path):
            entries = _list(fs, root, data_path)[: 1 if first_only else None]
            urls = [fs.unstrip_protocol(path) if is_url(data_path) else path for path, _ in entries]
            footers = _footers(fs, entries, urls)
    except OSError as e:  # missing bucket, no permission, network
        raise ConfigError(
            f"--data_path {data_path} cannot be read ({type(e).__name__}: {e}): check the path or "
            "URL and the storage credentials (e.g. the AWS_* variables)"
        ) from e
    return fs, [DataFile(url, path, size, metadata) for url, (path, size), metadata in zip(urls, entries, footers)]


@dataclass(frozen=True)
class CheckedFiles:
    """The Parquet files of a job's --data_path and the columns it reads, checked against its
    options as far as the footers tell (schemas, and column statistics: null labels, ids out of
    range); what the loader opens, and what a job's submission checks (data/preflight.py)."""

    fs: fsspec.AbstractFileSystem
    files: list[DataFile]
    spec: ColumnSpec
    null_counts: dict[str, int | None]  # per flat column: nulls counted by the statistics (None: unknown)

    @classmethod
    def open(
        cls, model: ModelConfig, data: DataConfig, labelled: bool = True, trained: TrainedColumns | None = None
    ) -> "CheckedFiles":
        """The files of the data section, for the model section's features; ``labelled`` False:
        rows to score, whose label is not read; ``trained``: the columns a checkpoint's model
        read, in whose order they are fed."""
        fs, files = open_files(data.data_path)
        schemas = [(file.url, file.metadata.schema.to_arrow_schema()) for file in files]
        spec = resolve_columns(model, data, schemas, labelled)
        if trained is not None:
            spec = spec.ordered_as(ColumnSpec.from_record(trained.record), trained.checkpoint)
        sizes = as_is_sizes(data.categorical_ids, model.table_sizes, zch_features(model, data))
        return cls(fs, files, spec, check_statistics(files, spec, sizes))

    def splits(self, data: DataConfig) -> dict[str, Range]:
        """The rows of training, validation and test (:func:`held_out_split`, the files as days)."""
        return held_out_split(
            [file.rows for file in self.files],
            data.eval_days,
            data.eval_fraction,
            data.data_path,
            files="files",
            more="add files",
        )


def _list(fs: fsspec.AbstractFileSystem, root: str, data_path: str) -> list[tuple[str, int]]:
    """(path, size) of the data files: a glob's matches, a folder's .parquet files (at any depth;
    names starting with _ or ., such as Spark's _SUCCESS and _metadata, left out), or one file."""
    if is_pattern(root):
        found = fs.glob(root, detail=True)
    elif fs.isdir(root):
        found = {
            path: info
            for path, info in fs.find(root, detail=True).items()
            if _is_data_file(path[len(root.rstrip("/")) :])
        }
    elif fs.exists(root):
        found = {root: fs.info(root)}
    else:
        raise ConfigError(f"--data_path {data_path} does not exist: give a folder, glob or URL of Parquet files")
    found = {path: _followed(fs, path, info) for path, info in found.items()}
    files = sorted(
        ((path, int(info["size"])) for path, info in found.items() if info["type"] == "file"),
        key=lambda entry: natural_key(entry[0]),
    )
    if not files:
        raise ConfigError(
            f"--data_path {data_path} holds no Parquet file ({' or '.join(SUFFIXES)}, names not "
            "starting with _ or .): check the path, or give a glob of the files"
        )
    return files


def _followed(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> dict:
    """``info`` of a listed entry, or for a symlink its target's: a listing describes the link
    itself, neither file nor folder, and leaving it out would train on fewer files than given."""
    if not info.get("islink"):
        return info
    try:
        target = fs.info(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{path} is a symlink to {info.get('destination')}, which does not exist: fix the link or remove it"
        ) from None
    if target["type"] != "file":
        raise ConfigError(
            f"{path} is a symlink to the folder {info.get('destination')}, which --data_path does not "
            "search: give the folder's files by a glob, or copy them in"
        )
    return target


def _is_data_file(relative: str) -> bool:
    parts = [part for part in relative.split("/") if part]
    return relative.endswith(SUFFIXES) and not any(part.startswith(("_", ".")) for part in parts)


def _footers(fs: fsspec.AbstractFileSystem, entries: list[tuple[str, int]], urls: list[str]) -> list[pq.FileMetaData]:
    paths = [path for path, _ in entries]
    starts = [max(0, size - FOOTER_GUESS) for _, size in entries]
    tails = fs.cat_ranges(paths, starts, [size for _, size in entries], on_error="raise")
    return [_footer(fs, path, size, tail, url) for (path, size), tail, url in zip(entries, tails, urls)]


def _footer(fs: fsspec.AbstractFileSystem, path: str, size: int, tail: bytes, url: str) -> pq.FileMetaData:
    if len(tail) < _TAIL + len(_MAGIC) or tail[-4:] != _MAGIC:
        why = "its footer is encrypted" if tail[-4:] == _ENCRYPTED_MAGIC else "it does not end in PAR1"
        raise ConfigError(f"{url} is not a readable Parquet file ({why}): remove it from --data_path")
    length = int.from_bytes(tail[-_TAIL:-4], "little") + _TAIL
    if length > size:
        raise ConfigError(f"{url} is cut short (its footer claims {length:,} bytes of {size:,}): write it again")
    if length > len(tail):
        tail = fs.cat_file(path, size - length, size)
    try:
        return pq.read_metadata(pa.BufferReader(tail[-length:]))
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{url} has a corrupt footer ({e}): write it again") from e


def resolve_columns(
    model: ModelConfig, data: DataConfig, schemas: list[tuple[str, pa.Schema]], labelled: bool = True
) -> ColumnSpec:
    """The columns of the data section's options, patterns matched against the first schema, as
    many as the model section's features; every schema (a file's, named by its URL) checked to
    have them with types we read, alike in all of them. ``labelled`` False: no label column
    (rows to score)."""
    first_url, first = schemas[0]
    dense = match_columns(data.dense_columns, first.names, "dense_columns", first_url)
    sparse = match_columns(data.sparse_columns, first.names, "sparse_columns", first_url)
    _check_counts(model, data, first_url, {"dense_columns": dense, "sparse_columns": sparse})
    hashed = data.categorical_ids in ("hash", ZCH)
    managed = {sparse[k] for k in zch_features(model, data)}  # hashed too, into TorchRec's input range
    label = data.label_column if labelled else None
    names = [*([label] if label is not None else []), *dense, *sparse]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(
            f"column(s) {', '.join(twice)} would be read twice (as label, dense or sparse feature): "
            "give each column one role in --label_column, --dense_columns and --sparse_columns"
        )
    kinds: dict[str, tuple[str, str]] = {}  # column -> (kind, URL of the first file that has it)
    for url, schema in schemas:
        for name, option in [
            *([(label, "label_column")] if label is not None else []),
            *((n, "dense_columns") for n in dense),
            *((n, "sparse_columns") for n in sparse),
        ]:
            kind = _kind(schema, name, option, url, hashed or name in managed)
            first_kind, kind_url = kinds.setdefault(name, (kind, url))
            if kind != first_kind:
                raise ConfigError(
                    f"{url}: column {name!r} holds {_KIND_TEXT[kind]}, but {_KIND_TEXT[first_kind]} "
                    f"in {kind_url}: give it the same type in every file"
                )
    sparse_kinds = [kinds[name][0] for name in sparse]
    return ColumnSpec(
        label,
        dense,
        sparse,
        [k in ("list", "text_list") for k in sparse_kinds],
        [k.startswith("text") for k in sparse_kinds],
    )


@functools.cache
def first_file_columns(data_path: str) -> tuple[str, tuple[str, ...]]:
    """The URL and the column names of the first Parquet file of ``data_path`` (its footer only),
    read once per process: what a --zch_columns entry that a pattern matches is resolved against."""
    _, files = open_files(data_path, first_only=True)
    return files[0].url, tuple(files[0].metadata.schema.to_arrow_schema().names)


def zch_positions_in_files(model: ModelConfig, data: DataConfig) -> list[int]:
    """The sparse features (0-based) that --zch_columns names, its entries matched against the
    sparse columns the loader finds in the first file of --data_path (:func:`match_columns`), for
    entries the options alone cannot place (config.zch_features). Refused in one line: files that
    cannot be read here, an entry that names none of the sparse columns."""
    try:
        url, names = first_file_columns(data.data_path)
    except ConfigError as e:
        raise ConfigError(
            f"--zch_columns {','.join(data.zch_columns)} names columns that --sparse_columns "
            f"{','.join(data.sparse_columns)} matches in the files, which cannot be read here ({e}): name the "
            "columns one by one in --sparse_columns, or run this where --data_path can be read"
        ) from None
    sparse = match_columns(data.sparse_columns, list(names), "sparse_columns", url)
    _check_counts(model, data, url, {"sparse_columns": sparse})
    positions: set[int] = set()
    for entry in data.zch_columns:
        chosen = [k for k, name in enumerate(sparse) if fnmatch.fnmatchcase(name, entry)]
        if not chosen:
            raise ConfigError(
                f"--zch_columns {entry} names none of the sparse columns that --sparse_columns "
                f"{','.join(data.sparse_columns)} matches in {url}: {column_listing(sparse)}; name some of them"
            )
        positions.update(chosen)
    return sorted(positions)


def _check_counts(model: ModelConfig, data: DataConfig, url: str, matched: dict[str, list[str]]) -> None:
    """Refuses feature counts that differ from the columns the patterns match in ``url``: every
    wrong count in one message, so that one correction fixes them all."""
    wrong = [
        (option, _COUNTS[option], len(columns), getattr(model, _COUNTS[option]))
        for option, columns in matched.items()
        if len(columns) != getattr(model, _COUNTS[option])
    ]
    if wrong:
        found = " and ".join(
            f"--{option} {','.join(getattr(data, option))} matches {n} columns but --{count} is {given}"
            for option, count, n, given in wrong
        )
        fix = " ".join(f"--{count} {n}" for _, count, n, _ in wrong)
        raise ConfigError(f"in {url}, {found}: give {fix}, or name the columns one by one (their count then sets it)")


#: The feature count that each column option's matches must equal.
_COUNTS = {"dense_columns": "num_dense_features", "sparse_columns": "num_sparse_features"}


def match_columns(patterns: list[str], names: list[str], option: str, url: str) -> list[str]:
    """The columns ``patterns`` (of ``--option``) name among ``names`` (those of ``url``): a
    pattern's matches in natural order, other names as they are (an absent one is reported with
    its type check)."""
    columns = []
    for pattern in patterns:
        if not is_pattern(pattern):
            columns.append(pattern)
            continue
        matches = sorted((name for name in names if fnmatch.fnmatchcase(name, pattern)), key=natural_key)
        if not matches:
            raise ConfigError(
                f"--{option} {pattern} matches no column of {url}, whose columns are {column_listing(names)}: fix the "
                f"pattern{_layout_hint(names)}"
            )
        columns += matches
    return columns


def _layout_hint(names: list[str]) -> str:
    """The options of a well-known layout that ``names`` are, said where the patterns match nothing."""
    if {"I1", "C1"} <= set(names):  # NVTabular's Criteo example writes label, I1..I13, C1..C26
        return (
            " (these are NVTabular/Merlin's Criteo columns: --dense_columns 'I*' --sparse_columns 'C*'; their "
            "ids are Categorify'd, --categorical_ids as_is with its cardinalities as --num_embeddings_per_feature)"
        )
    return ""


def _kind(schema: pa.Schema, name: str, option: str, url: str, hashed: bool) -> str:
    """ "number", "int", "list" (of integers), "text" or "text_list" (strings or bytes, sparse
    columns whose values are ``hashed``): what column ``name`` is; else a ConfigError."""
    index = schema.get_field_index(name)
    if index < 0:
        raise ConfigError(
            f"{url} has no column {name!r} (--{option}); its columns are {column_listing(schema.names)}: "
            f"fix --{option}, or leave this file out of --data_path"
        )
    arrow_type = schema.field(index).type
    kind = _kind_of(arrow_type)
    if option == "sparse_columns" and kind in ("text", "text_list") and not hashed:
        raise ConfigError(
            f"{url}: column {name!r} (--sparse_columns) is {arrow_type}: text ids become table rows with "
            "--categorical_ids hash or zch (as_is takes integers that are rows already)"
        )
    allowed = ("int", "list", "text", "text_list") if option == "sparse_columns" else ("int", "number")
    if kind is None or kind not in allowed:
        wanted = "integers, text or lists of them (ids)" if option == "sparse_columns" else "numbers"
        raise ConfigError(
            f"{url}: column {name!r} (--{option}) is {arrow_type}, but it must hold {wanted}: cast it where "
            f"the files are written (e.g. CAST in Spark or BigQuery), or leave it out of --{option}"
        )
    return "number" if kind == "int" and option != "sparse_columns" else kind


_KIND_TEXT = {
    "number": "numbers",
    "int": "integers",
    "list": "lists of integers",
    "text": "text",
    "text_list": "lists of text",
}


def _kind_of(arrow_type: pa.DataType) -> str | None:
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type) or pa.types.is_decimal(arrow_type):
        return "number"  # a decimal read as float32, as a double is
    if _is_text(arrow_type):
        return "text"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        if pa.types.is_integer(arrow_type.value_type):
            return "list"
        if _is_text(arrow_type.value_type):
            return "text_list"
    return None


def _is_text(arrow_type: pa.DataType) -> bool:
    return any(
        check(arrow_type)
        for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    )


def column_listing(names: list[str], shown: int = 12) -> str:
    return ", ".join(names[:shown]) + (f" ... ({len(names)} in all)" if len(names) > shown else "")


def as_is_sizes(categorical_ids: str, table_sizes: list[int], managed: list[int]) -> list[int | None] | None:
    """With --categorical_ids as_is, per sparse feature the table its ids must lie in (None for
    the ``managed`` ones, --zch_columns: raw ids, hashed); None: no id must lie in its table."""
    if categorical_ids != "as_is":
        return None
    return [None if k in managed else size for k, size in enumerate(table_sizes)]


def check_statistics(
    files: list[DataFile], spec: ColumnSpec, table_sizes: list[int | None] | None
) -> dict[str, int | None]:
    """Refuses null labels, labels of one class only and (with ``table_sizes``, --categorical_ids
    as_is, per sparse column: None for one whose ids are not rows) ids outside their tables, as far
    as the files' statistics tell; returns the null count of every flat column (None where a file
    recorded none)."""
    nulls: dict[str, int | None] = {name: 0 for name in spec.names}
    labels: set[float] | None = set()  # the labels' minima and maxima; None: a row group without them
    for name, multi_hot in zip(spec.sparse, spec.multi_hot):
        if multi_hot:
            del nulls[name]
    ranges = {name: size for name, size in zip(spec.sparse, table_sizes or []) if size is not None}
    for file, g, name, stats in _statistics(files, spec.names):
        count = stats.null_count if stats is not None and stats.has_null_count else None
        if name == spec.label and count:
            raise null_label_error(file.url, name, g, count)
        if name == spec.label and stats is not None and stats.has_min_max:
            for value in (stats.min, stats.max):
                check_label(value, file.url, name, g)
            labels = None if labels is None else labels | {stats.min, stats.max}
        elif name == spec.label and file.metadata.row_group(g).num_rows:
            labels = None
        if name in nulls:
            nulls[name] = None if nulls[name] is None or count is None else nulls[name] + count
        if name in ranges and stats is not None and stats.has_min_max:
            for value in (stats.min, stats.max):
                check_id(value, ranges[name], file.url, name, g)
    if labels is not None and len(labels) == 1:
        raise ConfigError(
            f"label column {spec.label!r} holds only {labels.pop():g} in {column_listing([f.url for f in files], 3)} "
            "(their statistics say so): a model learns nothing from one class; check --label_column, or add "
            "the rows of the other class"
        )
    return nulls


def dense_ranges(files: list[DataFile], spec: ColumnSpec) -> dict[str, tuple[float, float]]:
    """Per dense column, the smallest and largest finite values the files' statistics record
    (columns without statistics in any file are left out: they are not judged)."""
    ranges: dict[str, tuple[float, float]] = {}
    for _, _, name, stats in _statistics(files, spec.dense):
        if stats is None or not stats.has_min_max:
            continue
        values = [v for v in (float(stats.min), float(stats.max)) if math.isfinite(v)]
        if values:
            low, high = ranges.get(name, (math.inf, -math.inf))
            ranges[name] = (min(low, *values), max(high, *values))
    return {name: ranges[name] for name in spec.dense if name in ranges}


def _statistics(files: list[DataFile], names: list[str]) -> Iterator[tuple[DataFile, int, str, pq.Statistics | None]]:
    """(file, row group, column, its chunk's statistics or None) of every row group of ``files``,
    for each of the columns ``names`` (which the reader reads: a column of one leaf each)."""
    for file in files:
        leaves = leaf_columns(file.metadata)
        for g in range(file.metadata.num_row_groups):
            group = file.metadata.row_group(g)
            for name in names:
                yield file, g, name, group.column(leaves[name][0]).statistics


def unscaled_dense(ranges: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Of :func:`dense_ranges`, the columns that reach beyond ``UNSCALED_DENSE`` either way, each
    with its largest magnitude."""
    largest = {name: max(abs(low), abs(high)) for name, (low, high) in ranges.items()}
    return {name: value for name, value in largest.items() if value > UNSCALED_DENSE}


def leaf_columns(metadata: pq.FileMetaData) -> dict[str, range]:
    """Per top-level column, the indices of its leaf (physical) columns, whose chunks and
    statistics the footer holds. Counted from the columns' types, leaves being in column order:
    a leaf's dotted path cannot tell column ``cat.0`` from field ``0`` of column ``cat``."""
    leaves, at = {}, 0
    for field in metadata.schema.to_arrow_schema():
        count = _leaf_count(field.type)
        leaves[field.name] = range(at, at + count)
        at += count
    return leaves


def _leaf_count(arrow_type: pa.DataType) -> int:
    fields = [arrow_type.field(i) for i in range(arrow_type.num_fields)]
    return sum(_leaf_count(field.type) for field in fields) if fields else 1


def null_label_error(url: str, column: str, group: int, count: int) -> ConfigError:
    return ConfigError(
        f"{url}: label column {column!r} has {count:,} null values (row group {group}): a "
        "row without its label cannot train; drop or fill those rows where the files are written"
    )


def check_label(value: float, url: str, column: str, group: int) -> None:
    if value not in (0, 1):
        raise ConfigError(
            f"{url}: label column {column!r} holds {value:g} (row group {group}), but a label is a "
            "click (1) or not (0): map the labels to 0 and 1 where the files are written"
        )


def check_id(value: int, table_size: int, url: str, column: str, group: int) -> None:
    if not 0 <= value < table_size:
        raise ConfigError(
            f"{url}: column {column!r} holds id {value} (row group {group}), outside its embedding "
            f"table of {table_size:,} rows: with --categorical_ids as_is every id must be in "
            f"[0, {table_size:,}); use --categorical_ids hash, or larger --num_embeddings_per_feature"
        )


def null_report(nulls: dict[str, int | None]) -> str:
    """The start-up log line of the null counts."""
    counted = {name: n for name, n in nulls.items() if n}
    unknown = [name for name, n in nulls.items() if n is None]
    text = ", ".join(f"{name} {n:,}" for name, n in counted.items()) or "none"
    if unknown:
        text += f"; not recorded in some files' statistics for {column_listing(unknown)}"
    return text
