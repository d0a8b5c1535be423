"""TorchX components for sharded DLRM training with TorchRec.

    torchx run -s local_cwd components.dlrm:train -j 1x2
    torchx run -s slurm components.dlrm:train -j 2x8 -h aws_p4d.24xlarge --batch_size 8192

Every component builds its role with TorchX's own ``dist.torchrun`` and runs an app module
of this project (``python -m apps.dlrm.train``); the app's options are this component's
arguments, so ``torchx run components.dlrm:train --help`` is the app's manual too.
"""

from torchx import specs
from torchx.components import dist

from apps.dlrm.config import TrainConfig
from apps.dlrm.options import to_argv
from components.launch import Launch
from components.signature import component_args, reject_unknown, take


@component_args(Launch, TrainConfig)
def train(**kwargs) -> specs.AppDef:
    """Trains, validates and tests a DLRM whose embedding tables are sharded across all ranks.

    Runs ``python -m apps.dlrm.train`` under torchrun on every node: TorchRec's planner shards
    the EmbeddingBagCollection (DistributedModelParallel), TrainPipelineSparseDist overlaps the
    input all-to-all with compute, and validation/test AUROC, log loss and accuracy are synced
    across ranks. NCCL on GPUs, gloo on CPUs. summary.json and TensorBoard events go to
    --output_dir.
    """
    reject_unknown(kwargs, Launch, TrainConfig)
    launch = take(Launch, kwargs)
    cfg = take(TrainConfig, kwargs)
    return _torchrun_role(launch, "apps.dlrm.train", to_argv(cfg))


def _torchrun_role(launch: Launch, module: str, app_args: list[str]) -> specs.AppDef:
    return dist.torchrun(
        *app_args,
        m=module,
        image=launch.image,
        name=launch.name,
        h=launch.h or None,
        cpu=launch.cpu,
        gpu=launch.gpu,
        memMB=launch.memMB,
        j=launch.j,
        env=launch.merged_env,
        max_retries=launch.max_retries,
        rdzv_port=launch.rdzv_port,
        mounts=launch.mounts or None,
    )
