"""Training data sources, one room each: :mod:`.synthetic`, :mod:`.criteo` (the loader, and the
preprocessing that writes its folders), :mod:`.parquet`; :mod:`.prefetch` is their background
batch thread. Each yields TorchRec ``Batch`` objects partitioned across ranks: :class:`ClickLogs`,
made by :func:`make_dataset`.

Importing any module of this package runs this one first, and light importers need some of them:
:mod:`apps.dlrm.config` (the Criteo table sizes), ``python -m apps.dlrm.preprocess`` and the
components (the preprocessing), none of which loads torch. So this module imports torch, TorchRec,
the configuration's sections and the sources only for type checkers and inside :func:`make_dataset`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from apps.core.data import DataSource, RankShare

if TYPE_CHECKING:
    import torch
    from torchrec.datasets.utils import Batch

    from apps.core.common.distributed import DistEnv
    from apps.dlrm.config import DataConfig, ModelConfig
    from apps.dlrm.data.trained import TrainedColumns


class ClickLogs(DataSource["Batch"], Protocol):
    """A click-log source (:class:`~apps.core.data.DataSource` of TorchRec ``Batch`` objects),
    with what the DLRM's evaluation adds: the labels' hidden teacher, where there is one."""

    def teacher(self) -> Callable[[Batch], torch.Tensor] | None:
        """The logits of the hidden model the labels were drawn from, where the data has one
        (synthetic data): validation reports the AUROC they reach as its ceiling."""
        ...


def make_dataset(
    model: ModelConfig, data: DataConfig, share: RankShare, env: DistEnv, trained: TrainedColumns | None = None
) -> ClickLogs:
    """This rank's source of the data section (``share``: where it reads; ``env``: the device and
    the node it runs on); ``trained``: the columns of the checkpoint whose model it feeds
    (Parquet matches the options' columns, then orders them as that model read them)."""
    # Each source is imported only where it is chosen: the Parquet loader's pyarrow alone adds
    # ~0.7 s to the start of every other job.
    pin_memory = env.device.type == "cuda"
    if data.data == "criteo":
        from apps.dlrm.data.criteo.fetch import local_folder
        from apps.dlrm.data.criteo.loader import CriteoClickLogs

        # A URL is copied to a node-local cache once per node, by its first local rank.
        folder = local_folder(data.data_path, data.data_cache_dir, copier=env.local_rank == 0)
        return CriteoClickLogs(model, data, share, folder, pin_memory, local_world_size=env.local_world_size)
    if data.data == "parquet":
        from apps.dlrm.data.parquet.loader import ParquetClickLogs

        # Streamed where the files are: each rank reads only its share of the row groups.
        return ParquetClickLogs(model, data, share, pin_memory, trained=trained)
    from apps.dlrm.data.synthetic import SyntheticClickLogs

    return SyntheticClickLogs(model, data, share, device=env.device)
