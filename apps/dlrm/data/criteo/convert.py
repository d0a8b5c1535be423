"""Converting one input file into one day of the binary layout (runs in a worker process).

A day streams through in blocks of about a megabyte of text, so memory does not grow with the
size of the file. With ``--categorical_ids hash`` a day is complete after one pass. With
``vocabulary`` the first pass writes the raw 32-bit values and their counts, and the second
(:func:`finish_day`, once the vocabulary of all days exists) turns them into ids. With
``--output_format parquet`` the complete arrays then become the day's Parquet file
(:mod:`apps.dlrm.data.criteo.to_parquet`), before the day's report marks it complete.
"""

import os
from typing import Callable

import numpy as np

from apps.dlrm.data.criteo import vocabulary
from apps.dlrm.data.criteo.layout import (
    ARRAYS,
    CAT_FEATURES,
    VOCABULARY_DIR,
    NpyAppender,
    array_file,
    day_report_file,
    read_json,
    write_json,
)
from apps.dlrm.data.criteo.parse import LineCounts, Rows, read_blocks
from apps.dlrm.data.criteo.sources import Source, open_lines
from apps.dlrm.data.criteo.to_parquet import remove_arrays, write_parquet_day

# Rows of raw values turned into ids at once in the vocabulary's second pass.
_LOOKUP_ROWS = 1 << 18


class DayFailed(Exception):
    """A day could not be converted (unreadable or corrupt file); its message names the file."""


def printable(text: str) -> str:
    """``text`` with every character that does not print as itself escaped (``\\x1b``), on one
    line: an error may quote input bytes, which must never reach a terminal as they are."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def dense_features(ints: np.ndarray) -> np.ndarray:
    """log(1 + x) of the non-negative part of the integer features ([13, n]), as float32 [n, 13]."""
    dense = ints.astype(np.float32)
    np.maximum(dense, 0, out=dense)
    dense += 1
    np.log(dense, out=dense)
    return np.ascontiguousarray(dense.T)


def hashed_ids(cats: np.ndarray, table_sizes: np.ndarray) -> np.ndarray:
    """Each categorical value ([26, n]) modulo its table's size, as int32 [n, 26]."""
    ids = cats % table_sizes[:, None]
    # Table sizes are below 2**31 (checked by the config): the uint32 ids are valid int32.
    return np.ascontiguousarray(ids.view(np.int32).T)


def lines_file(output: str, day: str) -> str:
    """A day's line counts between the vocabulary's two passes."""
    return os.path.join(output, VOCABULARY_DIR, f"{day}_lines.json")


def convert_day(
    source: Source,
    output: str,
    table_sizes: list[int] | None,
    progress: Callable[[int], None],
    *,
    output_format: str = "npy",
) -> dict | None:
    """Converts ``source`` into day ``source.day`` of ``output``.

    With ``table_sizes`` (hash ids) the day is complete afterwards, in ``output_format``, and its
    report is returned; without (vocabulary ids) the raw values and their counts are written for
    the second pass.
    """
    day = source.day
    counts = LineCounts()
    writers = {
        name: NpyAppender(os.path.join(output, array_file(day, name)), dtype, columns)
        for name, (dtype, columns) in ARRAYS.items()
        if name != "sparse" or table_sizes is not None
    }
    vocab_dir = os.path.join(output, VOCABULARY_DIR)
    counter = None
    if table_sizes is None:
        writers["values"] = NpyAppender(vocabulary.values_file(vocab_dir, day), np.dtype("<u4"), CAT_FEATURES)
        counter = vocabulary.ValueCounter()
    sizes = np.array(table_sizes, dtype=np.uint32) if table_sizes is not None else None
    try:
        with open_lines(source.url) as (stream, position):
            done = 0
            for rows in read_blocks(stream, counts):
                _append(writers, rows, sizes, counter)
                progress(position() - done)
                done = position()
            progress(position() - done)
        counts.written = writers["labels"].rows
        digests = {name: writer.commit() for name, writer in writers.items()}
    except Exception as e:
        for writer in writers.values():
            writer.discard()
        raise DayFailed(printable(f"{source.url}: {type(e).__name__}: {e}")) from e
    report = {**counts.to_json(), "files": {array_file(day, name): digests[name] for name in ARRAYS if name in digests}}
    if counter is not None:
        counter.save(vocabulary.counts_file(vocab_dir, day))
        write_json(lines_file(output, day), report)  # last: marks the first pass done
        return None
    return _complete(output, day, report, output_format)


def _complete(output: str, day: str, report: dict, output_format: str) -> dict:
    """Writes the day's Parquet file if asked to, then its report: the mark of a complete day."""
    if output_format == "parquet":
        try:
            report["files"] = write_parquet_day(output, day)
        except Exception as e:
            raise DayFailed(printable(f"day {day}: writing Parquet: {type(e).__name__}: {e}")) from e
    write_json(os.path.join(output, day_report_file(day)), report)  # marks the day done
    if output_format == "parquet":
        remove_arrays(output, day)  # now the Parquet file holds the day
    return report


def _append(
    writers: dict[str, NpyAppender], rows: Rows, sizes: np.ndarray | None, counter: vocabulary.ValueCounter | None
) -> None:
    writers["dense"].append(dense_features(rows.ints))
    writers["labels"].append(rows.labels[:, None])
    if counter is None:
        assert sizes is not None, "hash ids (no vocabulary counter) need the table sizes"
        writers["sparse"].append(hashed_ids(rows.cats, sizes))
    else:
        writers["values"].append(np.ascontiguousarray(rows.cats.T))
        counter.add(rows.cats)


def finish_day(output: str, day: str, progress: Callable[[int], None], *, output_format: str = "npy") -> dict:
    """The vocabulary's second pass over a day: values -> ids; returns the day's report."""
    vocab_dir = os.path.join(output, VOCABULARY_DIR)
    values_path = vocabulary.values_file(vocab_dir, day)
    values = np.load(values_path, mmap_mode="r")
    table = vocabulary.Vocabulary(vocab_dir)
    dtype, columns = ARRAYS["sparse"]
    sparse = NpyAppender(os.path.join(output, array_file(day, "sparse")), dtype, columns)
    try:
        for start in range(0, values.shape[0], _LOOKUP_ROWS):
            block = np.asarray(values[start : start + _LOOKUP_ROWS])
            sparse.append(table.lookup(block))
            progress(block.nbytes)
        digest = sparse.commit()
    except Exception as e:
        sparse.discard()
        raise DayFailed(printable(f"day {day}: {type(e).__name__}: {e}")) from e
    report = read_json(lines_file(output, day))
    report.setdefault("files", {})[array_file(day, "sparse")] = digest
    _complete(output, day, report, output_format)
    os.remove(values_path)  # the ids replace the raw values
    return report
