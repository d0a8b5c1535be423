"""The cluster a training job will run on, as TorchRec's planner needs to know it.

A job is described with ``components.dlrm:train``'s own ``-j`` and ``-h`` (or ``--gpu`` and
``--memMB``), checked by the same launcher code: this module turns them into ranks, ranks per
node, and each rank's HBM and host memory, resolving ``-j`` exactly as TorchX's
``dist.torchrun`` does when it launches the job. It needs neither torch nor a GPU, so
components can check their arguments with it cheaply.
"""

from dataclasses import dataclass
from typing import Any

from torchx import specs
from torchx.components.dist import parse_nnodes
from torchx.components.structured_arg import StructuredJArgument
from torchx.specs.named_resources_aws import K8S_ITYPE

from apps.dlrm.options import ConfigError, option
from components.launch import Launch

GiB = 1024**3
MiB = 1024**2

#: HBM of one GPU in GiB (nominal), by AWS instance family (``p4d`` of ``p4d.24xlarge``) or by
#: whole instance type: named resources say how many GPUs a node has, not how much memory each
#: has. --hbm_gb gives it for any other type.
GPU_HBM_GIB = {
    "p3": 16,  # V100 16 GB
    "p3dn": 32,  # V100 32 GB
    "p4d": 40,  # A100 40 GB
    "p4de": 80,  # A100 80 GB
    "p5": 80,  # H100 80 GB
    "p5e": 141,  # H200
    "p5en": 141,  # H200
    "g4dn": 16,  # T4
    "g5": 24,  # A10G
    "g6": 24,  # L4
    "g6e": 48,  # L40S
    "Standard_ND96asr_v4": 40,  # Azure, A100 40 GB
    "a2-highgpu-8g": 40,  # Google Cloud, A100 40 GB
    "a3-highgpu-8g": 80,  # Google Cloud, H100 80 GB
}


def hbm_gb_option() -> Any:
    """``--hbm_gb``, the one GPU fact named resources lack (the plan preview's and --check_plan's)."""
    return option(
        0.0,
        "HBM of one GPU in GiB; 0: known from the instance type of -h ("
        + ", ".join(GPU_HBM_GIB)
        + ").",
    )


@dataclass(frozen=True)
class Cluster:
    nodes: int
    nproc_per_node: int
    device: str  # "cuda" or "cpu", as TorchRec's planner names them
    hbm_per_rank: int  # bytes; 0 on CPU ranks
    ddr_per_rank: int  # bytes: the node's host memory shared by its ranks
    node: str  # what a node is, for people: "aws_p4d.24xlarge", "a node of 8 GPUs and 65536 MB"

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def describe(self) -> str:
        per_node = _count(self.nproc_per_node, "GPU" if self.device == "cuda" else "process")
        return f"{_count(self.nodes, 'node')} x {per_node} ({_count(self.world_size, 'rank')}) of {self.node}"


@dataclass
class PlanTarget:
    """The training job to plan for, described with components.dlrm:train's own arguments."""

    j: str = option(
        "1x2",
        "Job size of the training job, as for components.dlrm:train: NNODESxNPROC_PER_NODE "
        "(e.g. 2x8), MIN:MAXxNPROC_PER_NODE (planned for MIN nodes, where each rank holds the "
        "most), or NPROC for one node (with -h: a node count, one process per GPU).",
    )
    h: str = option(
        "",
        "Named resource of each node (e.g. aws_p4d.24xlarge): its GPUs, host memory and instance "
        "type. Empty: nodes of --gpu GPUs and --memMB host memory.",
    )
    gpu: int = option(0, "GPUs per node when no -h is given; 0 plans for CPU ranks.")
    memMB: int = option(8192, "Host memory per node in MB when no -h is given.")
    hbm_gb: float = hbm_gb_option()

    def __post_init__(self) -> None:
        if self.hbm_gb < 0:
            raise ConfigError(f"--hbm_gb {self.hbm_gb} must be 0 or more")
        # -j, -h, --gpu and --memMB are refused exactly as the training job's launcher refuses them
        # (at most one process per GPU among them).
        launch = Launch(j=self.j, h=self.h or None, gpu=self.gpu, memMB=self.memMB)
        self.cluster = self._resolve(launch.resource or specs.Resource(cpu=1, gpu=self.gpu, memMB=self.memMB))

    def _resolve(self, resource: specs.Resource) -> Cluster:
        j = self.j
        if self.h and j.isdigit():  # what dist.torchrun does with a bare -j and a named resource
            j = str(StructuredJArgument.parse_from(self.h, j))
        min_nodes, _, nproc, _ = parse_nnodes(j)
        if not resource.gpu and self.hbm_gb:
            raise ConfigError(
                f"--hbm_gb {self.hbm_gb} is for GPU nodes, but the job's nodes have no GPUs: give "
                "-h with GPUs (e.g. aws_p4d.24xlarge) or --gpu"
            )
        return Cluster(
            nodes=min_nodes,
            nproc_per_node=nproc,
            device="cuda" if resource.gpu else "cpu",
            hbm_per_rank=int(self._hbm_gib(resource) * GiB) if resource.gpu else 0,
            ddr_per_rank=resource.memMB * MiB // nproc,
            node=self.h or f"a node of {resource.gpu} GPUs and {resource.memMB} MB",
        )

    def _hbm_gib(self, resource: specs.Resource) -> float:
        if self.hbm_gb:
            return self.hbm_gb
        instance_type = resource.capabilities.get(K8S_ITYPE, "")
        for key in (instance_type, instance_type.split(".")[0]):
            if key in GPU_HBM_GIB:
                return GPU_HBM_GIB[key]
        node = f"-h {self.h} ({instance_type or 'no instance type'})" if self.h else f"--gpu {self.gpu}"
        raise ConfigError(
            f"how much memory a GPU of {node} has is not known: give it with --hbm_gb "
            "(e.g. --hbm_gb 80 for an H100 80 GB)"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"
