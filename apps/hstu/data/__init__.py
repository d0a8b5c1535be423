"""The HSTU app's sequence data: :mod:`.batch` (``SequenceBatch``), :mod:`.synthetic` (users from a
hidden transition process with a known ceiling), :mod:`.parquet` (sequences in Parquet files),
:mod:`.source` (what both share: leave-last-out splits and the batches' order; ``make_dataset``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from apps.core.data import RankShare
    from apps.hstu.config import HSTUModelConfig, SequenceDataConfig
    from apps.hstu.data.source import SequenceSource


def make_dataset(
    model: HSTUModelConfig, data: SequenceDataConfig, share: RankShare, device: torch.device
) -> SequenceSource:
    """The source of --data that ``share`` says this rank reads: synthetic users generated on
    ``device``, or the users of --data_path's Parquet files (read on the CPU; the train pipeline
    moves each batch)."""
    from apps.hstu.data.parquet import ParquetSequences
    from apps.hstu.data.synthetic import SyntheticSequences

    if data.data == "parquet":
        return ParquetSequences(model, data, share)
    return SyntheticSequences(model, data, share, device)
