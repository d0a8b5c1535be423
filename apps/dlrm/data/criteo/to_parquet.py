"""A preprocessed day as one Parquet file (``--output_format parquet``): NVTabular's Criteo output
(reference 003), made on CPUs.

NVTabular (reference 003) exists to turn Criteo TSV into Parquet on GPUs with Categorify,
FillMissing and LogOp, and to feed training from that Parquet. ``python -m apps.dlrm.preprocess
--output_format parquet`` writes the same kind of result with this project's transforms, which
are the npy layout's (:mod:`apps.dlrm.data.criteo.layout`), value for value:

=========================  =======  ====================================================
column                     type     value
=========================  =======  ====================================================
``label``                  int32    the click, 0 or 1
``int_0`` ... ``int_12``   float32  FillMissing (0) then LogOp: log(1 + max(x, 0))
``cat_0`` ... ``cat_25``   int32    the embedding row: with ``--categorical_ids vocabulary``
                                    Categorify with ``--frequency_threshold`` (values numbered
                                    in order of first appearance from 2, rare ones 1, then
                                    modulo the table size); with ``hash`` the value modulo it
=========================  =======  ====================================================

The names are those of TorchRec's Criteo constants and NVTabular scripts (``DEFAULT_LABEL_NAME``,
``DEFAULT_INT_NAMES``, ``DEFAULT_CAT_NAMES``), and the defaults of ``--label_column``,
``--dense_columns`` and ``--sparse_columns``: the folder trains with ``--data parquet
--categorical_ids as_is``. Unlike reference 003's diagram, no Normalize: the DLRM recipes this
project follows (TorchRec's, MLPerf's) train on the log values, and so do the npy days.

A day is converted from its complete npy arrays (memory-mapped, a row group at a time), which are
removed once the day is complete: both formats hold exactly the same rows, a folder only one. A row
group has :data:`ROW_GROUP_ROWS` rows: large enough that a request to an object store moves
megabytes, small enough to shuffle a day in many pieces (the loader permutes row groups).
"""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from apps.dlrm.data.criteo.layout import ARRAYS, array_file, file_digest, parquet_file, temporary_name
from apps.dlrm.data.criteo.parse import CAT_NAMES, INT_NAMES, LABEL

#: Rows of a row group: ~20 MB of values, ~1,500 row groups for a day of the Criteo 1TB logs.
ROW_GROUP_ROWS = 1 << 17

SCHEMA = pa.schema(
    [(LABEL, pa.int32())] + [(name, pa.float32()) for name in INT_NAMES] + [(name, pa.int32()) for name in CAT_NAMES]
)


def write_parquet_day(folder: str, day: str) -> dict[str, dict]:
    """Writes day ``day``'s arrays of ``folder`` as ``<day>.parquet``; returns the Parquet file's
    name, size and SHA-256 (as the day report records its files). The arrays are left for
    :func:`remove_arrays`, once the day's report marks it complete: a day interrupted before
    that is converted again from them."""
    arrays = {name: np.load(os.path.join(folder, array_file(day, name)), mmap_mode="r") for name in ARRAYS}
    path = os.path.join(folder, parquet_file(day))
    tmp = temporary_name(path)
    try:
        with pq.ParquetWriter(tmp, SCHEMA) as writer:
            rows = arrays["labels"].shape[0]
            for start in range(0, rows, ROW_GROUP_ROWS) if rows else [0]:
                writer.write_table(_row_group(arrays, start, start + ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
        with open(tmp, "rb+") as f:  # on disk before it takes its final name, as the npy files are
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {parquet_file(day): file_digest(path)}


def remove_arrays(folder: str, day: str) -> None:
    for name in ARRAYS:
        os.remove(os.path.join(folder, array_file(day, name)))


def _row_group(arrays: dict[str, np.ndarray], start: int, stop: int) -> pa.Table:
    dense, sparse = arrays["dense"][start:stop], arrays["sparse"][start:stop]
    columns = [arrays["labels"][start:stop, 0]]
    columns += [dense[:, j] for j in range(dense.shape[1])] + [sparse[:, j] for j in range(sparse.shape[1])]
    return pa.Table.from_arrays([pa.array(np.ascontiguousarray(c)) for c in columns], schema=SCHEMA)
