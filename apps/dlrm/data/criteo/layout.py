"""The binary layout of preprocessed Criteo click logs, and how it is written and read.

A preprocessed folder holds, for every input file ``<day>`` (its name without ``.gz``,
``.tsv``, ``.txt`` or ``.csv``), three NumPy ``.npy`` files with one row per sample, in the
order of the input lines that were kept::

    <day>_dense.npy    float32 [rows, 13]  log(1 + max(x, 0)) of the 13 integer features;
                                           a missing value counts as 0 (so it becomes 0.0)
    <day>_sparse.npy   int32   [rows, 26]  the 26 categorical features as embedding-table
                                           rows: feature f is in [0, num_embeddings_f); with
                                           --categorical_ids hash the 32-bit value modulo
                                           num_embeddings_f, a missing value being the value 0
                                           (as in TorchRec); vocabulary: see vocabulary.py
    <day>_labels.npy   int32   [rows, 1]   the click label, 0 or 1
    <day>_report.json  this file's counts (rows read, written, skipped and repaired per kind)
                       and the size and SHA-256 of its three arrays; written last, so its
                       presence marks the day as complete

and, for the whole folder::

    manifest.json      format and version, the settings every day was written with (table
                       sizes, how categorical values became ids), the days in order and
                       ("files") the size and SHA-256 of every file of every complete day: a
                       copy of the folder (a URL --data_path) is checked against them
    report.json        the counts of all days together (rows_read, rows_written, skipped,
                       repaired) and per day
    vocabulary/        only with --categorical_ids vocabulary: per-day value counts and the
                       per-feature vocabularies (see apps.dlrm.data.criteo.vocabulary)

With ``--output_format parquet`` a day is one Parquet file instead of its three arrays,
``<day>.parquet``, holding the same values (see apps.dlrm.data.criteo.to_parquet); the manifest then
records ``"output_format": "parquet"``, and such a folder trains with ``--data parquet``.

``.npy`` is NumPy's own format (version 1.0: a 128-byte header, then the little-endian,
C-ordered array), so every file is memory-mapped with ``np.load(path, mmap_mode="r")``. The
names, shapes and dtypes are those of TorchRec's binary Criteo files, so TorchRec's
``InMemoryBinaryCriteoIterDataPipe`` reads them too.

Arrays are streamed to disk as they are produced: a file starts with a header reserving room
for any row count, rows are appended, and the header is rewritten with the final shape when
the file is complete. Every file is written under a temporary name and renamed when complete,
so a folder never holds a partial file under a final name.
"""

import hashlib
import io
import json
import os
import re
import reprlib
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from apps.core.common.errors import ConfigError
from apps.dlrm.data.criteo.tables import CAT_FEATURES, INT_FEATURES

FORMAT = "dlrm-criteo-npy"
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
REPORT = "report.json"
VOCABULARY_DIR = "vocabulary"

#: Array name -> (dtype, columns) of every day.
ARRAYS = {
    "dense": (np.dtype("<f4"), INT_FEATURES),
    "sparse": (np.dtype("<i4"), CAT_FEATURES),
    "labels": (np.dtype("<i4"), 1),
}

# Room for the largest possible row count: the header is rewritten in place once rows are known.
_HEADER_PLACEHOLDER_ROWS = np.iinfo(np.int64).max


def array_file(day: str, array: str) -> str:
    return f"{day}_{array}.npy"


def day_report_file(day: str) -> str:
    return f"{day}_report.json"


def parquet_file(day: str) -> str:
    return f"{day}.parquet"


def data_files(day: str, output_format: str = "npy") -> list[str]:
    """The files that hold one day's rows."""
    return [parquet_file(day)] if output_format == "parquet" else [array_file(day, name) for name in ARRAYS]


def day_files(day: str) -> list[str]:
    """The files of one day of the npy layout, the report (the completion mark) last."""
    return data_files(day) + [day_report_file(day)]


def require_npy_days(manifest: dict, where: str) -> None:
    """Refuses a folder of Parquet days where the npy arrays are memory-mapped (--data criteo)."""
    if manifest.get("output_format", "npy") != "npy":
        raise ConfigError(
            f"{where} holds Parquet days (`python -m apps.dlrm.preprocess --output_format parquet`): "
            f"train on them with --data parquet --data_path {where} --categorical_ids as_is"
        )


def is_plain_name(name: object) -> bool:
    """Whether ``name`` can be a day: a file name that stays inside its folder and prints as
    itself. Not empty, no ``/``, no leading ``.`` (``..``, hidden and temporary names), no NUL
    or other control character (day names go into paths and into logs)."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".") and name.isprintable()


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 100


def shown(value: object) -> str:
    """``value`` for an error message, as read from a file or a name we do not control: a
    Python literal (control characters escaped, so nothing reaches a terminal as it is), cut
    if long."""
    return _SHOWN.repr(value)


_DIGEST_CHUNK = 1 << 20


def file_digest(path: str) -> dict:
    """The size and SHA-256 of the file ``path``, as the manifest records them."""
    sha256 = hashlib.sha256()  # read in chunks, as hashlib.file_digest does (Python 3.11+ only)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while chunk := f.read(_DIGEST_CHUNK):
            sha256.update(chunk)
    return {"size": size, "sha256": sha256.hexdigest()}


def temporary_name(path: str) -> str:
    """Where ``path`` is written before it is complete: a new hidden name in the same folder.

    Random, not predictable (as a process id is): no one can leave a symbolic link there in
    advance for us to write through.
    """
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )
    return out.getvalue()


class NpyAppender:
    """Writes a 2-D ``.npy`` file row block by row block, without knowing the row count first.

    The file is written under a temporary name; :meth:`commit` fixes the header and renames it.
    """

    def __init__(self, path: str, dtype: np.dtype, columns: int) -> None:
        self.path = path
        self.dtype = dtype
        self.columns = columns
        self.rows = 0
        self._tmp = temporary_name(path)
        self._header_len = len(_npy_header(dtype, (_HEADER_PLACEHOLDER_ROWS, columns)))
        self._file: BinaryIO = open(self._tmp, "wb")
        self._file.write(_npy_header(dtype, (_HEADER_PLACEHOLDER_ROWS, columns)))

    def append(self, rows: np.ndarray) -> None:
        assert rows.dtype == self.dtype and rows.ndim == 2 and rows.shape[1] == self.columns
        self._file.write(np.ascontiguousarray(rows).data)
        self.rows += rows.shape[0]

    def commit(self) -> dict:
        """Completes the file; returns its size and SHA-256 (:func:`file_digest`)."""
        header = _npy_header(self.dtype, (self.rows, self.columns))
        # The placeholder has the longest shape, and headers are padded to 64 bytes: same length.
        assert len(header) == self._header_len, (len(header), self._header_len)
        self._file.seek(0)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        # Read back rather than hashed while written: the header is rewritten last.
        return file_digest(self.path)

    def discard(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically (temporary name, then rename)."""
    tmp = temporary_name(path)
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def parse_manifest(text: str | bytes, where: str, fix: str) -> dict:
    """The manifest in ``text`` (read from ``where``), checked before any of it is used: our
    format and version, days that are plain file names (a manifest may come from a remote
    folder: a day ``../x`` must not reach a path), and well-formed checksums. Anything else is
    a ConfigError naming ``where`` and ending with ``fix``."""
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is not valid JSON ({e}): {fix}") from e
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (FORMAT, FORMAT_VERSION):
        found = manifest if isinstance(manifest, dict) else {}
        raise ConfigError(
            f"{where} describes format {shown(found.get('format'))} version "
            f"{shown(found.get('version'))}, but this code reads {FORMAT} version {FORMAT_VERSION}: {fix}"
        )
    days, files = manifest.get("days"), manifest.get("files", {})
    if not isinstance(days, list) or not isinstance(files, dict):
        raise ConfigError(f"{where} has no list of days or no table of files: {fix}")
    for day in days:
        if not is_plain_name(day):
            raise ConfigError(
                f"{where} names a day {shown(day)} that is not a plain file name (no '/', no "
                f"leading '.', no control character); `python -m apps.dlrm.preprocess` writes none: {fix}"
            )
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        ):
            raise ConfigError(f"{where} records no valid size and sha256 for {shown(name)}: {fix}")
    return manifest


def checksums(folder: str, days: list[str], output_format: str = "npy") -> dict[str, dict]:
    """File name -> size and SHA-256 of every file of the complete days of ``folder``: the
    manifest's ``files``. The data files' come from the day reports (hashed by the workers that
    wrote them); a report without them (written before checksums were recorded) gets them now."""
    files = {}
    for day in days:
        report_path = os.path.join(folder, day_report_file(day))
        if not os.path.exists(report_path):
            continue
        report = read_json(report_path)
        arrays = data_files(day, output_format)
        if not all(name in report.get("files", {}) for name in arrays):
            report["files"] = {name: file_digest(os.path.join(folder, name)) for name in arrays}
            write_json(report_path, report)
        files.update(report["files"])
        files[day_report_file(day)] = file_digest(report_path)
    return files


@dataclass
class DayArrays:
    """One complete day of a preprocessed folder, memory-mapped."""

    day: str
    dense: np.ndarray  # float32 [rows, 13]
    sparse: np.ndarray  # int32 [rows, 26]
    labels: np.ndarray  # int32 [rows, 1]

    @property
    def rows(self) -> int:
        return self.labels.shape[0]


def open_folder(folder: str) -> tuple[dict, list[DayArrays]]:
    """The manifest and the memory-mapped days of a preprocessed folder, checked for
    completeness and consistency; a folder that does not fit is a ConfigError naming the fix."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise ConfigError(
            f"{folder} has no {MANIFEST}: it is not a folder written by `python -m apps.dlrm.preprocess --output`"
        )
    with open(path, "rb") as f:
        manifest = parse_manifest(f.read(), path, "preprocess the click logs again")
    require_npy_days(manifest, folder)
    days = []
    for day in manifest["days"]:
        if not os.path.exists(os.path.join(folder, day_report_file(day))):
            raise ConfigError(
                f"day {day} of {folder} is incomplete (no {day_report_file(day)}): rerun "
                "`python -m apps.dlrm.preprocess` with the same options to finish it"
            )
        arrays = {}
        for name, (dtype, columns) in ARRAYS.items():
            array = np.load(os.path.join(folder, array_file(day, name)), mmap_mode="r")
            if array.dtype != dtype or array.ndim != 2 or array.shape[1] != columns:
                raise ConfigError(
                    f"{array_file(day, name)} in {folder} holds {array.dtype} {array.shape}, "
                    f"not {dtype} [rows, {columns}]: preprocess this day again"
                )
            arrays[name] = array
        if len({array.shape[0] for array in arrays.values()}) != 1:
            raise ConfigError(
                f"the files of day {day} in {folder} have different row counts "
                f"({', '.join(f'{k} {v.shape[0]}' for k, v in arrays.items())}): preprocess it again"
            )
        days.append(DayArrays(day, **arrays))
    return manifest, days


def check_table_sizes(preprocessed: list[int], training: list[int], folder: str) -> None:
    """Refuses tables smaller than those the folder's ids were preprocessed for (ids would overflow them)."""
    small = [f for f, (p, t) in enumerate(zip(preprocessed, training)) if t < p]
    if small:
        raise ConfigError(
            f"{folder} was preprocessed for embedding tables of "
            f"{','.join(map(str, preprocessed))} rows, but features "
            f"{', '.join(map(str, small[:5]))}{' ...' if len(small) > 5 else ''} have smaller "
            f"tables here ({','.join(map(str, training))}): train with "
            f"--num_embeddings_per_feature {','.join(map(str, preprocessed))} (or the "
            "--table_size_preset it was preprocessed with)"
        )
