"""TorchX components for sharded DLRM training with TorchRec.

    torchx run -s local_cwd components.dlrm:train -j 1x2
    torchx run -s slurm components.dlrm:train -j 2x8 -h aws_p4d.24xlarge --batch_size 8192
    torchx run components.dlrm:plan -j 2x8 -h aws_p4d.24xlarge --batch_size 8192   # does it fit?
    torchx run -s local_cwd components.dlrm:preprocess --input /data/criteo --output /data/criteo_npy
    torchx run -s local_cwd components.dlrm:export --checkpoint_dir s3://b/ckpt --output s3://b/pkg --quantize int8
    torchx run -s local_cwd components.dlrm:predict -j 1x2 --model s3://b/pkg --data parquet \
        --data_path s3://b/candidates/ --output s3://b/scores/ --passthrough_columns row_id

Every component runs an app module of this project (``python -m apps.dlrm.train``), training
ones under TorchX's own ``dist.torchrun``; the app's options are the component's arguments, so
``torchx run components.dlrm:train --help`` is the app's manual too.
"""

from typing import Any

from torchx import specs

from apps.core.launch.target import PlanTarget
from apps.core.options import to_argv
from apps.dlrm.config import JobConfig, PlanConfig, zch_features_here
from apps.dlrm.data.criteo.config import PreprocessConfig
from apps.dlrm.serving.config import ExportConfig, PredictConfig
from apps.dlrm.spec import SPEC
from components import torchx_logs
from components.cpu_launch import CpuLaunch
from components.launch import Launch, named_after, plan_preview
from components.plan_check import PlanCheck, check_tables_fit
from components.preflight import check_before_submitting, check_managed_world, needing_here
from components.signature import component_args, reject_unknown, take

# Before `torchx run` logs them: see components/torchx_logs.py for why here.
torchx_logs.drop_notices()

#: The launcher's arguments, the job named after the app (its folder: outputs/dlrm-<id>).
DLRMLaunch = named_after(Launch, SPEC)
DLRMCpuLaunch = named_after(CpuLaunch, SPEC)


@component_args(DLRMLaunch, PlanCheck, JobConfig)
def train(**kwargs: Any) -> specs.AppDef:
    """Trains, validates and tests a DLRM whose embedding tables are sharded across all ranks.

    Runs ``python -m apps.dlrm.train`` under torchrun on every node: TorchRec's planner shards
    the EmbeddingBagCollection (DistributedModelParallel), TrainPipelineSparseDist overlaps the
    input all-to-all with compute, and validation/test AUROC, log loss and accuracy are synced
    across ranks. NCCL on GPUs, gloo on CPUs. summary.json and TensorBoard events go to
    --output_dir, by default a new folder per run under outputs/ (named by the job's name and app
    id), where Slurm also writes the job's logs, and torchrun each attempt's logs and error files.
    """
    reject_unknown(kwargs, DLRMLaunch, PlanCheck, JobConfig)
    launch = take(DLRMLaunch, kwargs)
    cfg = take(JobConfig, kwargs)
    take(PlanCheck, kwargs).run(launch, cfg, SPEC)
    sizes = "--num_embeddings_per_feature" if cfg.model.num_embeddings_per_feature else "--num_embeddings"
    check_tables_fit(launch, cfg.model.table_sizes, cfg.model.embedding_dim, sizes, SPEC)
    managed = zch_features_here(cfg.model, cfg.data) or []  # None: the trainers read the files, and check
    check_managed_world(launch, {str(i): cfg.model.table_sizes[i] for i in managed}, sizes)
    missing = check_before_submitting(launch, cfg)
    return needing_here(launch.training_app(SPEC, cfg), missing)


@component_args(PlanTarget, PlanConfig)
def plan(**kwargs: Any) -> specs.AppDef:
    """Previews TorchRec's sharding plan of a training job and says whether it fits.

    Runs ``python -m apps.dlrm.plan``, one process on any machine, no GPU needed, in seconds:
    give it the -j/-h (or gpu/memMB) and model options of the components.dlrm:train job to
    check. It prints each table's placement and each rank's HBM and host memory by TorchRec's
    planner and estimates, then ``fits: ...`` or ``does not fit: needs X GiB HBM on rank r,
    has Y`` (and exits 3).
    """
    reject_unknown(kwargs, PlanTarget, PlanConfig)
    target = take(PlanTarget, kwargs)
    cfg = take(PlanConfig, kwargs)
    return plan_preview(SPEC, target, cfg)


@component_args(DLRMCpuLaunch, PreprocessConfig)
def preprocess(**kwargs: Any) -> specs.AppDef:
    """Converts Criteo TSV click logs (1TB or Kaggle) into the binary files --data criteo trains on.

    Runs ``python -m apps.dlrm.preprocess`` as one process on any scheduler, no GPU needed: it
    converts the input files in parallel over the node's cores (give it many with cpu or -h),
    streaming, so memory does not grow with the file size. Bad lines are skipped or repaired
    and counted per kind in --output/report.json; a rerun skips the days that are complete.
    """
    return DLRMCpuLaunch.component_app(kwargs, PreprocessConfig, "apps.dlrm.preprocess")


@component_args(DLRMCpuLaunch, ExportConfig)
def export(**kwargs: Any) -> specs.AppDef:
    """Turns a training run's checkpoint into an inference package for serving and batch scoring.

    Runs ``python -m apps.dlrm.export`` as one process on any scheduler, no GPU needed, on a host
    with the memory for the whole model (give it with memMB or -h): the checkpoint that --step
    names (of any sharding and world size) is loaded whole, its tables optionally quantized, the
    model exported with torch.export and written to --output with manifest.json (features and
    their transforms, the model's options, the run's validations, the source checkpoint),
    atomically and never over anything.
    """
    return DLRMCpuLaunch.component_app(kwargs, ExportConfig, "apps.dlrm.export")


@component_args(DLRMLaunch, PredictConfig)
def predict(**kwargs: Any) -> specs.AppDef:
    """Scores Parquet files, a preprocessed Criteo folder or Criteo click logs with a package or a checkpoint.

    Runs ``python -m apps.dlrm.predict`` under torchrun on every node: each rank loads the whole
    model and scores its share of the input files, writing one Parquet file of predictions per
    input file (--passthrough_columns, then score) to --output, and rank 0 report.json (rows read,
    scored and skipped, and why). An --output that holds anything is refused, so a job restarted
    (--max_retries) after it began writing stops there: score into a new --output.
    """
    reject_unknown(kwargs, DLRMLaunch, PredictConfig)
    launch = take(DLRMLaunch, kwargs)
    cfg = take(PredictConfig, kwargs)
    return launch.torchrun_app("apps.dlrm.predict", to_argv(cfg))
