"""Scoring data in batch (``components.dlrm:predict``): Parquet files, a preprocessed Criteo folder
or Criteo's click logs, with an inference package or straight from a checkpoint, over any number of
ranks.

Every rank loads the whole model (:func:`apps.dlrm.serving.api.open_model`) and scores its share of
the input files (Parquet files, Criteo days, or click logs), dealt out by their row counts (a click
log's: its bytes), largest first, to the rank with the least so far. Each input file gives one
Parquet file of predictions under ``--output``, named after it: the ``--passthrough_columns`` (a
row id, the label...) and ``score``, row for row in the input's order, written whole
(:func:`apps.dlrm.serving.outputs.write_file`). Once every rank is done, rank 0 writes
``report.json``: per file and in all, the rows read, scored, skipped (and why) and repaired (and
how), the dense values read as 0, the model's source and the throughput. An ``--output`` that holds
anything is refused before anything is read: nothing is overwritten. The job holds its
``--output`` while it writes it (:func:`apps.dlrm.serving.outputs.claim`): a second job into the
same place is refused, and a place that cannot be written (disk full, read-only) stops the job
in one line naming the file, no file left half-written.

Rows are read as training read them (:mod:`apps.dlrm.serving.features`). A Parquet row that
training would refuse is skipped instead, and counted: with ``--categorical_ids as_is``, a row
with an id outside its table. Criteo days hold preprocessed rows, which are all scored. A line of a
click log that preprocessing would skip is skipped, and counted by kind
(:mod:`apps.dlrm.data.criteo.parse`); its fields repaired, as preprocessing repairs them, are counted
too (:mod:`apps.dlrm.serving.criteo_tsv`).
"""

import collections
import json
import logging
import os
import posixpath
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Mapping, Protocol

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch.distributed as dist

from apps.core.common.distributed import DistEnv, decided_by_main
from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls
from apps.dlrm.data.criteo.fetch import local_folder
from apps.dlrm.data.criteo.layout import check_table_sizes, open_folder
from apps.dlrm.data.criteo.parse import CAT_NAMES, INT_NAMES, LineCounts
from apps.dlrm.data.criteo.sources import find_sources
from apps.dlrm.data.parquet.files import ColumnSpec, as_is_sizes, check_statistics, open_files
from apps.dlrm.serving.api import Model, open_model
from apps.dlrm.serving.config import PredictConfig
from apps.dlrm.serving.criteo_tsv import NOT_IN_VOCABULARY, PREPROCESSED_OPTION, CriteoIds
from apps.dlrm.serving.features import Features, RowScorer
from apps.dlrm.serving.outputs import claim, release, withdraw, write_file

logger = logging.getLogger("apps.dlrm.serving")

#: The predictions' column of click probabilities.
SCORE = "score"
REPORT_FILE = "report.json"
#: Rows of a Criteo day scored at once (its arrays are memory-mapped).
CRITEO_CHUNK_ROWS = 1 << 18
#: What a Criteo day can pass through: its label, and the row's number in the day.
CRITEO_PASSTHROUGH = {"label": pa.int32(), "row": pa.int64()}
OUT_OF_TABLE = "id outside its table (--categorical_ids as_is)"


@dataclass
class InputFile:
    url: str  #: as messages and the report name it
    output: str  #: the name of its predictions' file
    size: int  #: what dealing balances: its rows (a click log: its bytes)


@dataclass
class Scored:
    """What scoring one input file did."""

    input: str
    output: str
    rows_read: int = 0
    rows_scored: int = 0
    rows_skipped: dict[str, int] = field(default_factory=dict)
    rows_repaired: dict[str, int] = field(default_factory=dict)


class Inputs(Protocol):
    """The files to score and how their rows are read."""

    files: list[InputFile]
    spec: ColumnSpec  #: the columns that feed the model
    null_counts: dict[str, int | None]  #: per column, nulls read as 0 or as no id (None: not recorded)

    def output_schema(self, passthrough: list[str]) -> pa.Schema:
        """The predictions' columns: ``passthrough`` as the inputs hold them, then the score."""
        ...

    def tables(self, index: int, passthrough: list[str]) -> Iterator[tuple[pa.Table, int]]:
        """File ``index``'s rows, in order: tables of the spec's and ``passthrough``'s columns,
        each with the row group (or chunk) it is, for messages."""
        ...

    def skipped(self, table: pa.Table) -> dict[str, np.ndarray]:
        """Per reason, which of ``table``'s rows cannot be scored (a boolean mask)."""
        ...

    def dropped(self, index: int) -> tuple[dict[str, int], dict[str, int]]:
        """The rows of file ``index`` that :meth:`tables` left out, per reason, and those it
        repaired, per kind (a click log's lines): known once its tables are read."""
        ...


# --- the job -------------------------------------------------------------------------------------


def predict(cfg: PredictConfig, env: DistEnv) -> dict[str, Any]:
    """Collective: scores this rank's share of ``cfg.data_path``; returns the report (every rank)."""
    start = time.perf_counter()
    made = decided_by_main(lambda: claim(cfg.output, _job_id()), env)
    try:
        model = open_model(cfg.model, cfg.step, "--model")
        inputs = open_inputs(cfg, model, model.features, env)
    except BaseException:  # a refused model or input: nothing was written, nothing is left
        if env.is_main:
            withdraw(cfg.output, made)
        raise
    mine = deal([file.size for file in inputs.files], env.world_size)[env.rank]
    scorer = RowScorer(model.module, model.features, inputs.spec, cfg.batch_size)
    scoring = time.perf_counter()
    try:
        scored, error = [_score_file(inputs, i, scorer, cfg) for i in mine], None
    except ConfigError as e:  # every rank stops with it, not only this one
        scored, error = [], str(e)
    ranks: list[Any] = [None] * env.world_size
    dist.all_gather_object(
        ranks, _RankResult(scored, error, dict(scorer.decoder.nonfinite), time.perf_counter() - scoring)
    )
    errors = [rank.error for rank in ranks if rank.error]
    if errors:
        raise ConfigError(errors[0])
    report = _report(cfg, model, inputs, ranks, time.perf_counter() - start)
    if env.is_main:
        fs, root = fsspec.core.url_to_fs(cfg.output)
        text = (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()
        write_file(fs, posixpath.join(root, REPORT_FILE), lambda f: f.write(text))
        release(cfg.output)
        _log_files(ranks)
        logger.info(
            "scored %s rows of %d files (%s skipped) in %.1f s, %.0f rows/s on %d ranks; report: %s",
            f"{report['rows_scored']:,}",
            len(report["files"]),
            f"{sum(report['rows_skipped'].values()):,}",
            report["scoring_seconds"],
            report["rows_per_second"],
            env.world_size,
            redact_urls(posixpath.join(cfg.output, REPORT_FILE)),
        )
    return report


def _job_id() -> str:
    """What names this job in its --output while it writes it: host, process and a random part."""
    return f"{socket.gethostname()}/pid {os.getpid()}/{uuid.uuid4().hex[:8]}"


def deal(sizes: list[int], ranks: int) -> list[list[int]]:
    """Which files (indices into ``sizes``) each rank scores: the largest first, each to the rank
    with the least so far (the lowest such rank on ties); each rank's in file order."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(share) for share in shares]


def _score_file(inputs: Inputs, index: int, scorer: RowScorer, cfg: PredictConfig) -> Scored:
    """Scores input file ``index`` into its predictions' file."""
    file = inputs.files[index]
    fs, root = fsspec.core.url_to_fs(cfg.output)
    scored = Scored(redact_urls(file.url), redact_urls(posixpath.join(cfg.output, file.output)))
    skipped: collections.Counter = collections.Counter()
    schema = inputs.output_schema(cfg.passthrough_columns)

    def write(out: IO[bytes]) -> None:
        with pq.ParquetWriter(out, schema) as writer:
            for table, group in inputs.tables(index, cfg.passthrough_columns):
                scored.rows_read += table.num_rows
                reasons = inputs.skipped(table)
                if reasons:
                    for reason, mask in reasons.items():
                        skipped[reason] += int(mask.sum())
                    table = table.filter(pa.array(~np.logical_or.reduce(list(reasons.values()))))
                rows = scorer.decode(table.select(inputs.spec.names), file.url, group)
                scores = pa.array(scorer.score(rows), type=pa.float32())
                writer.write_table(table.select(cfg.passthrough_columns).append_column(SCORE, scores).cast(schema))
                scored.rows_scored += table.num_rows

    write_file(fs, posixpath.join(root, file.output), write)
    dropped, scored.rows_repaired = inputs.dropped(index)
    skipped.update(dropped)
    scored.rows_read += sum(dropped.values())
    scored.rows_skipped = dict(skipped)
    return scored


@dataclass
class _RankResult:
    """What one rank did: its files, its error (a ConfigError's message), the dense values it read
    as 0 per column, and how long it took to read, score and write its files."""

    scored: list[Scored]
    error: str | None
    nonfinite: dict[str, int]
    seconds: float


def _log_files(ranks: list[_RankResult]) -> None:
    """A line per scored file, every rank's: rank 0 logs them once all are gathered, as the
    other ranks log warnings only (:func:`~apps.core.training.report.setup_logging`)."""
    for rank, result in enumerate(ranks):
        for scored in result.scored:
            logger.info(
                "rank %d scored %s: %s rows -> %s", rank, scored.input, f"{scored.rows_scored:,}", scored.output
            )


def _report(
    cfg: PredictConfig, model: Model, inputs: Inputs, ranks: list[_RankResult], seconds: float
) -> dict[str, Any]:
    files = sorted((vars(s) for rank in ranks for s in rank.scored), key=lambda s: s["input"])
    skipped: collections.Counter = collections.Counter()
    repaired: collections.Counter = collections.Counter()
    made_zero: collections.Counter = collections.Counter()
    for file in files:
        skipped.update(file["rows_skipped"])
        repaired.update(file["rows_repaired"])
    for rank in ranks:
        made_zero.update(rank.nonfinite)
    rows = sum(file["rows_scored"] for file in files)
    scoring = max(rank.seconds for rank in ranks)
    return {
        "model": redact_urls(cfg.model),
        "source": model.manifest.get("source"),
        "data": cfg.data,
        "data_path": redact_urls(cfg.data_path),
        "output": redact_urls(cfg.output),
        "columns": {"dense": inputs.spec.dense, "sparse": inputs.spec.sparse, "passthrough": cfg.passthrough_columns},
        "rows_read": sum(file["rows_read"] for file in files),
        "rows_scored": rows,
        "rows_skipped": dict(skipped),
        "rows_repaired": dict(repaired),
        "dense_nan_or_infinite_read_as_0": dict(made_zero),
        "nulls_read_as_0_or_no_id": {name: n for name, n in inputs.null_counts.items() if n != 0},
        "files": files,
        "world_size": len(ranks),
        "seconds": seconds,
        "scoring_seconds": scoring,
        "rows_per_second": rows / scoring if scoring else 0.0,
    }


# --- the inputs ----------------------------------------------------------------------------------


def open_inputs(cfg: PredictConfig, model: Model, features: Features, env: DistEnv) -> Inputs:
    if cfg.data == "criteo":
        return CriteoInputs(cfg, features, env)
    if cfg.data == "criteo_tsv":
        return CriteoTsvInputs(cfg, model, features)
    return ParquetInputs(cfg, features)


class ParquetInputs:
    """The Parquet files of ``--data_path``, their columns checked against the model's features
    and ``--passthrough_columns`` before any row is read."""

    def __init__(self, cfg: PredictConfig, features: Features) -> None:
        self.fs, self.data_files = open_files(cfg.data_path)
        schemas = [(file.url, file.metadata.schema.to_arrow_schema()) for file in self.data_files]
        self.spec = features.spec(schemas, cfg.dense_columns, cfg.sparse_columns)
        self.table_sizes = as_is_sizes(features.categorical_ids, features.table_sizes, features.zch_features)
        self.null_counts = check_statistics(self.data_files, self.spec, None)  # refuses nothing without a label
        for url, schema in schemas:
            missing = [name for name in cfg.passthrough_columns if name not in schema.names]
            if missing:
                raise ConfigError(
                    f"{url} has no column {missing[0]!r} (--passthrough_columns); its columns are "
                    f"{', '.join(schema.names[:12])}{' ...' if len(schema.names) > 12 else ''}: fix --passthrough_columns"
                )
        self.first_schema = schemas[0][1]
        self.files = [InputFile(file.url, _output_name(file.url, cfg.data_path), file.rows) for file in self.data_files]
        names = [file.output for file in self.files]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(
                f"--data_path {redact_urls(cfg.data_path)}: several input files would write predictions named "
                f"{twice[0]}: give a folder (their paths below it name the predictions) rather than a glob"
            )

    def output_schema(self, passthrough: list[str]) -> pa.Schema:
        return pa.schema([*(self.first_schema.field(name) for name in passthrough), pa.field(SCORE, pa.float32())])

    def tables(self, index: int, passthrough: list[str]) -> Iterator[tuple[pa.Table, int]]:
        file = self.data_files[index]
        columns = list(dict.fromkeys([*self.spec.names, *passthrough]))
        with self.fs.open(file.path, "rb") as f:
            reader = pq.ParquetFile(f, metadata=file.metadata)
            for g in range(file.metadata.num_row_groups):
                try:
                    table = reader.read_row_group(g, columns=columns)
                except (pa.ArrowException, OSError) as e:
                    raise ConfigError(
                        f"{file.url}: row group {g} cannot be decoded ({' '.join(str(e).split())}): the file is "
                        "corrupt; write it again, or leave it out of --data_path"
                    ) from e
                yield table, g

    def skipped(self, table: pa.Table) -> dict[str, np.ndarray]:
        """With as_is ids, the rows holding an id outside its table (training refuses those)."""
        if self.table_sizes is None:
            return {}
        bad = np.zeros(table.num_rows, dtype=bool)
        for name, multi_hot, size in zip(self.spec.sparse, self.spec.multi_hot, self.table_sizes):
            if size is None:  # raw ids (--zch_columns), which are no rows
                continue
            column = table.column(name).combine_chunks()
            values = pc.list_flatten(column) if multi_hot else column
            outside = pc.fill_null(pc.or_(pc.less(values, 0), pc.greater_equal(values, size)), False)
            outside_np = outside.to_numpy(zero_copy_only=False)
            if multi_hot:
                bad[pc.list_parent_indices(column).to_numpy()[outside_np]] = True
            else:
                bad |= outside_np
        return {OUT_OF_TABLE: bad} if bad.any() else {}

    def dropped(self, index: int) -> tuple[dict[str, int], dict[str, int]]:
        return {}, {}  # skipped() finds the rows left out


class _CriteoRows:
    """What the inputs of Criteo rows share: the columns of preprocessing's Parquet days
    (``int_*`` float32, ``cat_*`` int64: a model trained on Criteo reads those), and the label and
    the row's number in its day passed through."""

    schema = pa.schema([*((name, pa.float32()) for name in INT_NAMES), *((name, pa.int64()) for name in CAT_NAMES)])

    def __init__(self, cfg: PredictConfig, features: Features, where: str) -> None:
        unknown = [name for name in cfg.passthrough_columns if name not in CRITEO_PASSTHROUGH]
        if unknown:
            raise ConfigError(
                f"--passthrough_columns {','.join(unknown)}: a Criteo day passes through "
                f"{' and '.join(CRITEO_PASSTHROUGH)} only"
            )
        self.spec = features.spec([(where, self.schema)], cfg.dense_columns, cfg.sparse_columns)
        self.null_counts: dict[str, int | None] = {}  # preprocessing's parser fills them (its report counts them)

    def output_schema(self, passthrough: list[str]) -> pa.Schema:
        return pa.schema([*((name, CRITEO_PASSTHROUGH[name]) for name in passthrough), (SCORE, pa.float32())])

    def _table(
        self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, first: int, passthrough: list[str]
    ) -> pa.Table:
        """Rows ``first``... of a day (dense float32 [rows, 13], ids [rows, 26], labels [rows]) as a
        table of the spec's and ``passthrough``'s columns."""
        columns = {
            **{name: dense[:, j] for j, name in enumerate(INT_NAMES)},
            **{name: ids[:, k].astype(np.int64) for k, name in enumerate(CAT_NAMES)},
            "label": labels,
            "row": np.arange(first, first + len(labels), dtype=np.int64),
        }
        return pa.table({name: columns[name] for name in [*self.spec.names, *passthrough]})

    def skipped(self, table: pa.Table) -> dict[str, np.ndarray]:
        return {}  # preprocessed rows are all in their tables (check_table_sizes)


class CriteoInputs(_CriteoRows):
    """The days of a folder written by ``python -m apps.dlrm.preprocess``, memory-mapped."""

    def __init__(self, cfg: PredictConfig, features: Features, env: DistEnv) -> None:
        folder = local_folder(cfg.data_path, cfg.data_cache_dir, copier=env.local_rank == 0)
        manifest, self.days = open_folder(folder)
        check_table_sizes(manifest["num_embeddings_per_feature"], features.table_sizes, folder)
        super().__init__(cfg, features, folder)
        base = cfg.data_path.rstrip("/")
        self.files = [InputFile(f"{base}/{day.day}", f"{day.day}.parquet", day.rows) for day in self.days]

    def tables(self, index: int, passthrough: list[str]) -> Iterator[tuple[pa.Table, int]]:
        day = self.days[index]
        for chunk, lo in enumerate(range(0, day.rows, CRITEO_CHUNK_ROWS)):
            hi = min(lo + CRITEO_CHUNK_ROWS, day.rows)
            yield self._table(day.dense[lo:hi], day.sparse[lo:hi], day.labels[lo:hi, 0], lo, passthrough), chunk

    def dropped(self, index: int) -> tuple[dict[str, int], dict[str, int]]:
        return {}, {}  # preprocessing dropped and repaired lines (its report counts them)


class CriteoTsvInputs(_CriteoRows):
    """Criteo's click logs (TSV, plain or gzip), each line parsed and made into the row that the
    model's preprocessed folder holds for it (:mod:`apps.dlrm.serving.criteo_tsv`): a line
    preprocessing skips is skipped, counted by kind; a file's predictions are named after its day
    (``day_23.gz`` -> ``day_23.parquet``), as those of its preprocessed day are."""

    def __init__(self, cfg: PredictConfig, model: Model, features: Features) -> None:
        folder, given = cfg.preprocessed_path, PREPROCESSED_OPTION
        if not folder:
            folder, given = model.training_data_path, "the training run's --data_path"
            if not folder:
                raise ConfigError(
                    "--data criteo_tsv: the model trained on data of no folder (--data synthetic), so nothing records "
                    "how click logs become its ids: score click logs with a model trained on a folder of "
                    f"`python -m apps.dlrm.preprocess`, or give {PREPROCESSED_OPTION}"
                )
        self.ids = CriteoIds(folder, given, features.table_sizes)
        self.sources = find_sources([cfg.data_path], "--data_path")
        super().__init__(cfg, features, cfg.data_path)
        self.files = [InputFile(source.url, f"{source.day}.parquet", source.size) for source in self.sources]
        self._counts: dict[int, LineCounts] = {}
        self._not_in_vocabulary: dict[int, int] = {}

    def tables(self, index: int, passthrough: list[str]) -> Iterator[tuple[pa.Table, int]]:
        counts = self._counts[index] = LineCounts()
        self._not_in_vocabulary[index] = 0
        first = 0
        for chunk, block in enumerate(self.ids.blocks(self.sources[index].url, counts, CRITEO_CHUNK_ROWS)):
            self._not_in_vocabulary[index] += int(block.unseen.sum())
            yield self._table(block.dense, block.ids, block.labels, first, passthrough), chunk
            first += len(block)

    def dropped(self, index: int) -> tuple[dict[str, int], dict[str, int]]:
        """The lines of file ``index`` skipped, and those repaired, per kind (of parse.py)."""
        counts = self._counts[index]
        repaired = {**counts.repaired, NOT_IN_VOCABULARY: self._not_in_vocabulary[index]}
        return _nonzero(counts.skipped), _nonzero(repaired)


def _nonzero(counts: Mapping[str, int]) -> dict[str, int]:
    return {kind: n for kind, n in counts.items() if n}


def _output_name(url: str, data_path: str) -> str:
    """The predictions' file of the input ``url``: its path below ``data_path`` (a folder), or its
    name, with '/' as '__' and the suffix .parquet."""
    base = data_path.rstrip("/")
    relative = url[len(base) + 1 :] if url.startswith(base + "/") else posixpath.basename(url)
    stem = os.path.splitext(relative)[0]
    return stem.replace("/", "__") + ".parquet"
