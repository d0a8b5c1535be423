"""Training data sources. Each yields TorchRec ``Batch`` objects partitioned across ranks."""

from apps.dlrm.config import TrainConfig
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.distributed import DistEnv


def make_dataset(cfg: TrainConfig, env: DistEnv) -> SyntheticClickLogs:
    return SyntheticClickLogs(cfg, rank=env.rank, world_size=env.world_size)
