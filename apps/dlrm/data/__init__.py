"""Training data sources, one room each: :mod:`.synthetic`, :mod:`.criteo` (the loader, and the
preprocessing that writes its folders), :mod:`.parquet`; :mod:`.prefetch` is their background
batch thread. Each yields TorchRec ``Batch`` objects partitioned across ranks: :class:`ClickLogs`,
made by :func:`make_dataset`.

Importing any module of this package runs this one first, and light importers need some of them:
:mod:`apps.dlrm.config` (the Criteo table sizes), ``python -m apps.dlrm.preprocess`` and the
components (the preprocessing), none of which loads torch. So this module imports torch, TorchRec,
the configuration and the sources only for type checkers and inside :func:`make_dataset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol

if TYPE_CHECKING:
    import torch
    from torchrec.datasets.utils import Batch

    from apps.core.common.distributed import DistEnv
    from apps.dlrm.config import JobConfig


class ClickLogs(Protocol):
    """A training data source: one rank's batches, each a pure function of (seed, step, rank), so
    that a resumed run reads exactly the batches an uninterrupted one reads."""

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of one pass over the training rows; None for data that never repeats (synthetic)."""
        ...

    @property
    def columns(self) -> dict[str, Any] | None:
        """The columns the model reads, as matched in the data (names in feature order, and
        kinds), which a checkpoint's manifest records for serving to check data against; None
        where the options alone fix them."""
        ...

    def train_batches(self, start_step: int = 0) -> Generator[Batch, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        ...

    def eval_batches(self, split: str, num_batches: int) -> Generator[Batch, None, None]:
        """This rank's batches of ``split`` ("val" or "test"), as many on every rank."""
        ...

    def teacher(self) -> Callable[[Batch], torch.Tensor] | None:
        """The logits of the hidden model the labels were drawn from, where the data has one
        (synthetic data): validation reports the AUROC they reach as its ceiling."""
        ...


@dataclass(frozen=True)
class TrainedColumns:
    """The columns a checkpoint's model trained on, which data read to resume or evaluate it
    feeds in their order: its manifest's record (``ColumnSpec.record``) and its URL (messages
    name it)."""

    record: dict[str, Any]
    checkpoint: str


def make_dataset(cfg: JobConfig, env: DistEnv, trained: TrainedColumns | None = None) -> ClickLogs:
    """This rank's data source of ``cfg``; ``trained``: the columns of the checkpoint whose model
    it feeds (Parquet matches the options' columns, then orders them as that model read them)."""
    # Each source is imported only where it is chosen: the Parquet loader's pyarrow alone adds
    # ~0.7 s to the start of every other job.
    pin_memory = env.device.type == "cuda"
    if cfg.data.data == "criteo":
        from apps.dlrm.data.criteo.fetch import local_folder
        from apps.dlrm.data.criteo.loader import CriteoClickLogs

        # A URL is copied to a node-local cache once per node, by its first local rank.
        folder = local_folder(cfg.data.data_path, cfg.data.data_cache_dir, copier=env.local_rank == 0)
        return CriteoClickLogs(
            cfg, folder, env.rank, env.world_size, pin_memory=pin_memory, local_world_size=env.local_world_size
        )
    if cfg.data.data == "parquet":
        from apps.dlrm.data.parquet.loader import ParquetClickLogs

        # Streamed where the files are: each rank reads only its share of the row groups.
        return ParquetClickLogs(cfg, rank=env.rank, world_size=env.world_size, pin_memory=pin_memory, trained=trained)
    from apps.dlrm.data.synthetic import SyntheticClickLogs

    return SyntheticClickLogs(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
