"""Training data sources. Each yields TorchRec ``Batch`` objects partitioned across ranks."""

from apps.dlrm.config import TrainConfig
from apps.dlrm.criteo.fetch import local_folder
from apps.dlrm.data.criteo import CriteoClickLogs
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.distributed import DistEnv


ClickLogs = SyntheticClickLogs | CriteoClickLogs


def make_dataset(cfg: TrainConfig, env: DistEnv) -> ClickLogs:
    if cfg.data == "criteo":
        # A URL is copied to a node-local cache once per node, by its first local rank.
        folder = local_folder(cfg.data_path, cfg.data_cache_dir, copier=env.local_rank == 0)
        return CriteoClickLogs(cfg, folder, rank=env.rank, world_size=env.world_size,
                               pin_memory=env.device.type == "cuda")
    return SyntheticClickLogs(cfg, rank=env.rank, world_size=env.world_size, device=env.device)
