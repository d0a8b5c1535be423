"""The HSTU app's sequence data: :mod:`.batch` (``SequenceBatch``), :mod:`.synthetic` (users from a
hidden transition process with a known ceiling), :mod:`.parquet` (sequences in Parquet files),
:mod:`.source` (what both share: leave-last-out splits and the batches' order; ``make_dataset``)."""
