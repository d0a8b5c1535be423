"""TorchX components for the HSTU generative recommender (Hierarchical Sequential Transduction
Units), trained with TorchRec on the machinery the DLRM app shares.

    torchx run -s local_cwd components.hstu:train -j 1x2
    torchx run -s slurm components.hstu:train -j 2x8 -h aws_p4d.24xlarge --data parquet --data_path s3://b/seqs/
    torchx run components.hstu:plan -j 2x8 -h aws_p4d.24xlarge --num_items 100000000   # does it fit?
    torchx run -s slurm components.hstu:train -j 2x8 -h aws_p4d.24xlarge --check_plan true ...  # only if it fits

Each runs an app module of this project (``python -m apps.hstu.train``), training under TorchX's
own ``dist.torchrun``; the app's options are the component's arguments, so
``torchx run components.hstu:train --help`` is the app's manual too.
"""

from typing import Any

from torchx import specs

from apps.core.launch.target import PlanTarget
from apps.core.zch.config import zch_of
from apps.hstu.config import JobConfig, PlanConfig
from apps.hstu.spec import SPEC
from components import torchx_logs
from components.launch import Launch, named_after, plan_preview
from components.plan_check import PlanCheck, check_tables_fit
from components.preflight import check_devices, check_managed_world
from components.signature import component_args, reject_unknown, take

# Before `torchx run` logs them: see components/torchx_logs.py for why here.
torchx_logs.drop_notices()


#: The launcher's arguments, the job named after the app (its folder: outputs/hstu-<id>).
HSTULaunch = named_after(Launch, SPEC)


@component_args(HSTULaunch, PlanCheck, JobConfig)
def train(**kwargs: Any) -> specs.AppDef:
    """Trains, validates and tests an HSTU generative recommender whose item and action tables
    are sharded across all ranks.

    Runs ``python -m apps.hstu.train`` under torchrun on every node: TorchRec's planner shards the
    EmbeddingCollection (DistributedModelParallel), HSTU layers read each user's jagged sequence of
    item and action embeddings, and leave-last-out HR@10, NDCG@10 and MRR (ranking: AUROC per
    action) are synced across ranks; on synthetic data beside the ceiling the hidden process
    allows. NCCL on GPUs, gloo on CPUs. summary.json and TensorBoard events go to --output_dir,
    by default a new folder per run under outputs/, with the logs of each attempt.
    """
    reject_unknown(kwargs, HSTULaunch, PlanCheck, JobConfig)
    launch = take(HSTULaunch, kwargs)
    cfg = take(JobConfig, kwargs)
    take(PlanCheck, kwargs).run(launch, cfg, SPEC)
    check_devices(launch, cfg)
    model = cfg.model
    check_tables_fit(launch, [model.num_items, model.num_actions], model.embedding_dim, "--num_items", SPEC)
    check_managed_world(launch, {"0": model.num_items} if zch_of(cfg) else {}, "--num_items")
    return launch.training_app(SPEC, cfg)


@component_args(PlanTarget, PlanConfig)
def plan(**kwargs: Any) -> specs.AppDef:
    """Previews TorchRec's sharding plan of an HSTU training job and says whether it fits.

    Runs ``python -m apps.hstu.plan``, one process on any machine, no GPU needed, in seconds:
    give it the -j/-h (or gpu/memMB) and model options of the components.hstu:train job to
    check. It prints each table's placement and each rank's HBM and host memory by TorchRec's
    planner and estimates, then ``fits: ...`` or ``does not fit: ...`` (and exits 3).
    """
    reject_unknown(kwargs, PlanTarget, PlanConfig)
    target = take(PlanTarget, kwargs)
    cfg = take(PlanConfig, kwargs)
    return plan_preview(SPEC, target, cfg)
