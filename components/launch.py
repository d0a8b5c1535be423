"""Where and how a role runs: the launcher arguments every DLRM component shares."""

import re
from dataclasses import dataclass

from apps.dlrm.options import ConfigError, option

#: The image built by the repository's Dockerfile (``docker build -t torchrec-dlrm .``).
DEFAULT_IMAGE = "torchrec-dlrm:latest"

#: Environment every trainer gets; the user's ``env`` is merged over it.
DEFAULT_ENV = {
    # Log lines reach `torchx log` as they are written, not when a buffer fills.
    "PYTHONUNBUFFERED": "1",
    # A failed or timed-out NCCL collective aborts the rank instead of hanging the job, so
    # torchrun (max_retries) or the scheduler can restart it from the last checkpoint.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
}

_JOB_SIZE = re.compile(r"^(?:(?P<min>\d+):)?(?P<nodes>\d+)(?:x(?P<nproc>\d+))?$")


@dataclass(frozen=True)
class JobSize:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int | None  # None: inferred from the named resource's GPU count


def parse_job_size(j: str) -> JobSize:
    """Parses ``-j``: ``NNODESxNPROC``, ``MIN:MAXxNPROC`` (elastic) or ``NPROC`` (one node)."""
    match = _JOB_SIZE.match(j.strip())
    if not match:
        raise ConfigError(
            f"-j {j!r} is not a job size: use NNODESxNPROC_PER_NODE (e.g. 1x2 or 2x8), "
            "MIN_NODES:MAX_NODESxNPROC_PER_NODE for an elastic job (e.g. 1:4x8), "
            "or a single number of processes on one node"
        )
    nodes = int(match["nodes"])
    nproc = match["nproc"]
    size = JobSize(
        min_nodes=int(match["min"]) if match["min"] else nodes,
        max_nodes=nodes,
        nproc_per_node=int(nproc) if nproc else None,
    )
    if min(size.min_nodes, size.max_nodes, size.nproc_per_node or 1) < 1 or size.nproc_per_node == 0:
        raise ConfigError(f"-j {j!r} asks for zero nodes or processes: every count must be >= 1")
    if size.min_nodes > size.max_nodes:
        raise ConfigError(
            f"-j {j!r}: the minimum node count {size.min_nodes} exceeds the maximum "
            f"{size.max_nodes}; write MIN:MAXxNPROC with MIN <= MAX"
        )
    return size


@dataclass
class Launch:
    name: str = option("dlrm", "Job name: {experiment}/{run}, {experiment}/ or {run}.")
    image: str = option(
        DEFAULT_IMAGE,
        "Container image with this project installed (ignored by local_cwd, which runs in "
        "the current directory).",
    )
    j: str = option(
        "1x2",
        "Job size: NNODESxNPROC_PER_NODE (e.g. 2x8), MIN:MAXxNPROC_PER_NODE for an elastic "
        "job, or NPROC for one node (with -h: a node count, one process per GPU).",
    )
    h: str | None = option(
        None,
        "Named resource of each node (e.g. aws_p4d.24xlarge); takes precedence over "
        "cpu, gpu and memMB.",
    )
    cpu: int = option(2, "CPUs per node, when no named resource -h is given.")
    gpu: int = option(0, "GPUs per node, when no named resource -h is given.")
    memMB: int = option(8192, "Memory per node in MB, when no named resource -h is given.")
    env: dict[str, str] = option(
        {},
        "Environment variables, KEY=VALUE,KEY2=VALUE2, merged over the defaults "
        + ", ".join(f"{k}={v}" for k, v in DEFAULT_ENV.items())
        + ".",
    )
    mounts: list[str] = option(
        [],
        "Mounts, e.g. type=bind,src=/data,dst=/data[,readonly] or type=volume,src=NAME,dst=PATH "
        "(see the scheduler's documentation).",
    )
    max_retries: int = option(
        0,
        "Times a failed job is restarted (each restart resumes from the newest checkpoint).",
    )
    rdzv_port: int = option(29500, "Port of the rendezvous on the first node (multi-node jobs).")

    def __post_init__(self) -> None:
        self.job_size = parse_job_size(self.j)
        for name in ("cpu", "memMB"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} {getattr(self, name)} must be positive")
        for name in ("gpu", "max_retries"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} {getattr(self, name)} must be 0 or more")

    @property
    def merged_env(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.env}
