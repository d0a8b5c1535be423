"""Parsing Criteo TSV click logs into arrays, counting and handling every kind of bad row.

A Criteo line is 40 tab-separated fields: the label (0 or 1), 13 integer features (decimal,
possibly negative) and 26 categorical features (8 hex digits, a 32-bit value); any feature may
be empty (a missing value). Arrow's CSV reader splits the lines (no quoting, no escapes: Criteo
has neither); the fields are then validated and converted with vectorised numpy, so no Python
code runs per line except for lines that are broken.

Policy for bad lines, counted per kind in the report:

======================  =========  =========================================================
kind                    action     what
======================  =========  =========================================================
``undecodable``         skipped    the line is not UTF-8 text (binary garbage)
``empty_line``          skipped    the line is empty, or all of its 40 fields are
``wrong_column_count``  skipped    the line does not have exactly 40 tab-separated fields
``bad_label``           skipped    the label is not ``0`` or ``1`` (empty, ``2``, ``x``, ...)
``bad_integer``         repaired   an integer feature is not a decimal integer of at most 18
                                   digits (``abc``, ``1.5``, ``+3``, ``0x1f``, ...): it is
                                   treated as missing
``bad_categorical``     repaired   a categorical feature is not exactly 8 hex digits: it is
                                   treated as missing
======================  =========  =========================================================

A skipped line is dropped whole, so the fields of one line never end up in another sample. A
repaired line counts once per kind however many of its fields were bad. A line that has several
problems is counted under the first that applies in the table's order. No error or log quotes
the bytes of a line.
"""

import io
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from apps.dlrm.data.criteo.tables import CAT_FEATURES, INT_FEATURES

SKIPPED_KINDS = ("undecodable", "empty_line", "wrong_column_count", "bad_label")
REPAIRED_KINDS = ("bad_integer", "bad_categorical")

LABEL = "label"
INT_NAMES = [f"int_{i}" for i in range(INT_FEATURES)]
CAT_NAMES = [f"cat_{i}" for i in range(CAT_FEATURES)]
COLUMN_NAMES = [LABEL, *INT_NAMES, *CAT_NAMES]

# 18 decimal digits always fit in an int64; Criteo's counts have at most 10.
_MAX_INT_DIGITS = 18
_STRICT_INT = re.compile(rb"-?[0-9]{1,%d}" % _MAX_INT_DIGITS)

# Bytes that can occur in a decimal integer field.
_INT_BYTES = np.zeros(256, dtype=bool)
_INT_BYTES[list(b"0123456789-")] = True

# Two bytes (little-endian uint16) that are two hex digits -> the byte they spell; else 0xFFFF.
_HEX_PAIR = np.full(1 << 16, 0xFFFF, dtype=np.uint16)
_HEX_CHARS = {c: i for i, c in enumerate(b"0123456789abcdef")} | {c: 10 + i for i, c in enumerate(b"ABCDEF")}
for _hi, _hv in _HEX_CHARS.items():
    for _lo, _lv in _HEX_CHARS.items():
        _HEX_PAIR[_hi | (_lo << 8)] = (_hv << 4) | _lv

HEX_DIGITS = 8


@dataclass
class Rows:
    """The kept lines of one block, as arrays."""

    labels: np.ndarray  # int32 [n]
    # Feature-major (one contiguous row per feature), as they are converted column by column.
    ints: np.ndarray  # int64 [13, n]; missing (and repaired) values are 0
    cats: np.ndarray  # uint32 [26, n]; the 32-bit values; missing (and repaired) values are 0

    def __len__(self) -> int:
        return self.labels.shape[0]


class LineCounts:
    """Lines read, written, skipped and repaired, per kind."""

    def __init__(self) -> None:
        self.read = 0
        self.written = 0
        self.skipped: Counter[str] = Counter({kind: 0 for kind in SKIPPED_KINDS})
        self.repaired: Counter[str] = Counter({kind: 0 for kind in REPAIRED_KINDS})

    def to_json(self) -> dict:
        return {
            "rows_read": self.read,
            "rows_written": self.written,
            "skipped": dict(self.skipped),
            "repaired": dict(self.repaired),
        }

    @classmethod
    def from_json(cls, value: dict) -> "LineCounts":
        counts = cls()
        counts.read = value["rows_read"]
        counts.written = value["rows_written"]
        counts.skipped.update(value["skipped"])
        counts.repaired.update(value["repaired"])
        return counts

    def add(self, other: "LineCounts") -> None:
        self.read += other.read
        self.written += other.written
        self.skipped.update(other.skipped)
        self.repaired.update(other.repaired)


# Arrow parses fastest in small blocks (they stay in the CPU cache) and numpy converts fastest
# in larger ones (fewer calls per row): parse 1 MB blocks (~4k lines), convert ~16k lines at once.
# Small blocks also keep Arrow's read-ahead (a number of blocks) small.
PARSE_BLOCK_BYTES = 1 << 20
CONVERT_LINES = 1 << 14


class DecodableLines(io.RawIOBase):
    """The lines of ``stream`` that are UTF-8 text, as a byte stream; the others are dropped and
    counted in ``undecodable``.

    Arrow's reader hands a line with the wrong number of fields to our handler as text, and
    fails the whole file when it is not UTF-8 (quoting its bytes in the error), so such lines
    must go before Arrow sees them. Criteo is ASCII: a block that is passes through at once.
    """

    def __init__(self, stream: pa.NativeFile) -> None:
        super().__init__()
        self.undecodable = 0
        self._stream = stream
        self._partial: list[bytes] = []  # the start of a line whose end is not read yet

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        """Whole lines (the last one of the stream may lack its newline); b"" at the end."""
        while True:
            chunk = self._stream.read(size)
            if not chunk:
                data, self._partial = b"".join(self._partial), []
                return self._decodable(data)
            end = chunk.rfind(b"\n") + 1
            self._partial.append(chunk[:end] if end else chunk)
            if end:
                data, self._partial = b"".join(self._partial), [chunk[end:]]
                # An empty result would read as the end of the stream: read on instead.
                if data := self._decodable(data):
                    return data

    def _decodable(self, data: bytes) -> bytes:
        if data.isascii() or _is_utf8(data):
            return data
        lines = data.split(b"\n")
        kept = [line for line in lines if _is_utf8(line)]
        self.undecodable += len(lines) - len(kept)
        return b"\n".join(kept)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_blocks(stream: pa.NativeFile, counts: LineCounts) -> Iterator[Rows]:
    """Parses a stream of Criteo TSV lines into blocks of kept rows, updating ``counts``."""

    wrong_column_count = 0
    stream = DecodableLines(stream)
    lock = threading.Lock()  # Arrow may call the handler from its parsing threads

    def invalid_row(row: pcsv.InvalidRow) -> str:
        # Only lines with a number of fields other than 40 come here (rare): Python is fine.
        nonlocal wrong_column_count
        with lock:
            wrong_column_count += 1
        return "skip"

    try:
        reader = _open_reader(stream, invalid_row)
    except pa.ArrowInvalid as e:
        if "Empty CSV file" in str(e):  # an empty file is a day without rows, not an error
            return
        raise
    parsed: list[pa.RecordBatch] = []
    lines = 0
    for batch in reader:
        parsed.append(batch)
        lines += batch.num_rows
        if lines >= CONVERT_LINES:
            yield convert(_concatenate(parsed), counts)
            parsed, lines = [], 0
    if parsed:
        yield convert(_concatenate(parsed), counts)
    counts.skipped["wrong_column_count"] += wrong_column_count
    counts.skipped["undecodable"] += stream.undecodable
    counts.read += wrong_column_count + stream.undecodable


def _open_reader(stream: pa.NativeFile, invalid_row: Callable[[pcsv.InvalidRow], str]) -> pcsv.CSVStreamingReader:
    return pcsv.open_csv(
        stream,
        read_options=pcsv.ReadOptions(
            column_names=COLUMN_NAMES,
            block_size=PARSE_BLOCK_BYTES,
            # Threads pay off only with cores to spare (one big file); else they cost CPU time.
            use_threads=pa.cpu_count() > 1,
        ),
        parse_options=pcsv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            escape_char=False,
            double_quote=False,
            newlines_in_values=False,
            # Empty lines are counted, not silently dropped: Arrow makes them rows of 40 nulls.
            ignore_empty_lines=False,
            invalid_row_handler=invalid_row,
        ),
        # Raw bytes: no UTF-8 validation, and every field is checked by us, not coerced.
        convert_options=pcsv.ConvertOptions(
            column_types={name: pa.binary() for name in COLUMN_NAMES},
            null_values=[""],
            strings_can_be_null=True,
        ),
    )


def _concatenate(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def convert(batch: pa.RecordBatch, counts: LineCounts) -> Rows:
    """Validates and converts a block of 40-field lines; drops empty ones and bad labels."""
    n = batch.num_rows
    counts.read += n
    columns = [_buffers(column) for column in batch.columns]
    any_field = np.zeros(n, dtype=bool)
    for _, lengths, _ in columns:
        any_field |= lengths != 0
    labels, good_label = _labels(*columns[0])
    ints = np.empty((INT_FEATURES, n), dtype=np.int64)
    bad_int = np.zeros(n, dtype=bool)
    for j in range(INT_FEATURES):
        ints[j], bad = _integers(batch.column(1 + j), *columns[1 + j])
        bad_int |= bad
    cats = np.empty((CAT_FEATURES, n), dtype=np.uint32)
    bad_cat = np.zeros(n, dtype=bool)
    for j in range(CAT_FEATURES):
        cats[j], bad = _hex_values(*columns[1 + INT_FEATURES + j])
        bad_cat |= bad
    counts.skipped["empty_line"] += int(n - any_field.sum())
    counts.skipped["bad_label"] += int((any_field & ~good_label).sum())
    counts.repaired["bad_integer"] += int((bad_int & good_label).sum())
    counts.repaired["bad_categorical"] += int((bad_cat & good_label & ~bad_int).sum())
    if good_label.all():
        return Rows(labels, ints, cats)
    return Rows(labels[good_label], ints[:, good_label], cats[:, good_label])


def _buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, data) of a binary column; a null (empty field) has length 0."""
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[column.offset : column.offset + len(column) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return offsets[:-1], np.diff(offsets), data


def _labels(starts: np.ndarray, lengths: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    one_byte = lengths == 1
    first = np.zeros(len(lengths), dtype=np.uint8)
    first[one_byte] = data[starts[one_byte]]
    good = one_byte & ((first == ord("0")) | (first == ord("1")))
    return np.where(good, first.astype(np.int32) - ord("0"), 0).astype(np.int32), good


def _integers(
    column: pa.Array, starts: np.ndarray, lengths: np.ndarray, data: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Values (missing and bad ones 0) and which fields were bad."""
    n = len(column)
    used = data[starts[0] + 0 : starts[-1] + lengths[-1]] if n else data[:0]
    # Arrow's integer parser is lenient (it takes 0x1f): cast only what has the strict shape.
    if np.take(_INT_BYTES, used).all() and lengths.max(initial=0) <= _MAX_INT_DIGITS:
        try:
            values = pc.cast(column.view(pa.string()), pa.int64())
            # Empty fields are nulls, whose slots hold no defined value: make them 0.
            raw = np.frombuffer(values.buffers()[1], dtype=np.int64)[values.offset : values.offset + n]
            return np.where(lengths > 0, raw, 0), np.zeros(n, dtype=bool)
        except pa.ArrowInvalid:  # a stray '-' ("1-2", "-"): the strict path finds which
            pass
    return _integers_strict(column)


def _integers_strict(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The per-field path for a column that holds at least one bad value (rare)."""
    values = np.zeros(len(column), dtype=np.int64)
    bad = np.zeros(len(column), dtype=bool)
    for i, field in enumerate(column.to_pylist()):
        if field is None:
            continue
        if _STRICT_INT.fullmatch(field):
            values[i] = int(field)
        else:
            bad[i] = True
    return values, bad


def _hex_values(starts: np.ndarray, lengths: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """32-bit values (missing and bad ones 0) and which fields were bad."""
    n = len(lengths)
    full = lengths == HEX_DIGITS
    bad = (lengths != 0) & ~full
    if bad.any():
        text = data[starts[full][:, None] + np.arange(HEX_DIGITS)]
    else:
        # Every value has 8 bytes and values are stored back to back: a zero-copy reshape.
        begin = starts[0] if n else 0
        text = data[begin : begin + HEX_DIGITS * int(full.sum())].reshape(-1, HEX_DIGITS)
    # Each pair of characters spells one byte of the big-endian 32-bit value.
    pairs = np.take(_HEX_PAIR, np.ascontiguousarray(text).view("<u2"))
    # A pair that is not two hex digits looks up 0xFFFF: test the 4 pairs of a value at once.
    not_hex = (pairs.view("<u8").reshape(-1) & np.uint64(0xFF00FF00FF00FF00)) != 0
    parsed = pairs.astype(np.uint8).view(">u4").reshape(-1).astype(np.uint32)
    if not_hex.any():
        parsed[not_hex] = 0
        bad[np.flatnonzero(full)[not_hex]] = True
    if full.all():
        return parsed, bad
    values = np.zeros(n, dtype=np.uint32)
    values[full] = parsed
    return values, bad
