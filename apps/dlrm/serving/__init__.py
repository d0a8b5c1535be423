"""After training: the model for serving and for scoring data in batch.

- :mod:`.trained`: a training run's checkpoint (any sharding, any world size) loaded whole into one
  process, through the checkpoint room's own store and readers;
- :mod:`.program`: the module a package holds (click probabilities of plain tensors), its tables
  optionally quantized, exported with ``torch.export``;
- :mod:`.package`: the package's format (the program and manifest.json), written atomically and
  read back with every check that keeps a planted file from running code;
- :mod:`.features`: rows given as columns (a table in memory, Parquet row groups, Criteo arrays)
  made into the program's inputs exactly as training made them into batches;
- :mod:`.api`: :func:`~apps.dlrm.serving.api.load_model`, for notebooks;
- :mod:`.export` and :mod:`.predict`: the jobs behind ``components.dlrm:export`` and ``:predict``.

This room builds on the model, the data sources and the checkpoints; nothing below it imports it.
"""
