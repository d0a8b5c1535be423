"""What a checkpoint says of the data its model trained on, for the data read to resume or
evaluate it: :class:`TrainedColumns`. A room of its own, free of torch and pyarrow, because the
training app makes one from a checkpoint's manifest and the Parquet source reads it, and neither
may import the other's side."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainedColumns:
    """The columns a checkpoint's model trained on, which data read to resume or evaluate it
    feeds in their order: its manifest's record (``ColumnSpec.record``) and its URL (messages
    name it)."""

    record: dict[str, Any]
    checkpoint: str
