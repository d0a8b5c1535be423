"""The cluster a training job will run on, as TorchRec's planner needs to know it.

A job is described with ``components.dlrm:train``'s own ``-j`` and ``-h`` (or ``--gpu`` and
``--memMB``), checked by the same launcher code: this module turns them into ranks, ranks per
node, and each rank's HBM and host memory, resolving ``-j`` exactly as TorchX's
``dist.torchrun`` does when it launches the job. It needs neither torch nor a GPU, so
components can check their arguments with it cheaply: only a job of ``--gpu`` GPUs whose memory
no option gives asks torch about this machine's GPU (:func:`local_gpu`).
"""

from dataclasses import dataclass

from torchx import specs
from torchx.components.dist import parse_nnodes
from torchx.components.structured_arg import StructuredJArgument
from torchx.specs.named_resources_aws import K8S_ITYPE

from apps.core.common.errors import ConfigError
from apps.core.launch.job_shape import JobShape
from apps.core.options import option

GiB = 1024**3
MiB = 1024**2

#: HBM of one GPU in GiB (nominal), by AWS instance family (``p4d`` of ``p4d.24xlarge``) or by
#: whole instance type: named resources say how many GPUs a node has, not how much memory each
#: has. JobConfig's --hbm_gb gives it for any other type (or less, to plan for part of a GPU).
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


@dataclass(frozen=True)
class Cluster:
    nodes: int
    nproc_per_node: int
    device: str  # "cuda" or "cpu", as TorchRec's planner names them
    hbm_per_rank: int  # bytes; 0 on CPU ranks
    ddr_per_rank: int  # bytes: the node's host memory shared by its ranks
    node: str  # what a node is, for people: "aws_p4d.24xlarge", "a node of 8 GPUs and 65536 MB"
    #: Where hbm_per_rank comes from, when neither -h nor --hbm_gb gave it: this machine's GPU.
    hbm_source: str = ""

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
        "Job size of the training job, as for the app's train component: NNODESxNPROC_PER_NODE "
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
    #: JobConfig's --hbm_gb, the GiB of HBM per rank to plan with (0: the -h type's GPU). A
    #: plain argument, not an option: the job's JobConfig carries it, so the app trains with
    #: the value the preview planned with, and the option is declared once. (components.dlrm:plan's
    #: ``take(PlanTarget, kwargs)`` fills it from that same --hbm_gb argument.)
    hbm_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.hbm_gb < 0:
            raise ConfigError(f"--hbm_gb {self.hbm_gb:g} must be 0 or more (0: the GPU's own memory)")
        if self.memMB <= 0:
            raise ConfigError(f"--memMB {self.memMB} must be positive")
        # -j, -h and --gpu are read and refused exactly as the training job's launcher reads them.
        shape = JobShape(self.j, self.h or None, self.gpu)
        self.cluster = self._resolve(shape.resource or specs.Resource(cpu=1, gpu=self.gpu, memMB=self.memMB))

    def _resolve(self, resource: specs.Resource) -> Cluster:
        j = self.j
        if self.h and j.isdigit():  # what dist.torchrun does with a bare -j and a named resource
            j = str(StructuredJArgument.parse_from(self.h, j))
        min_nodes, _, nproc, _ = parse_nnodes(j)
        check_hbm_gb(self.hbm_gb, resource, self.h)
        hbm, hbm_source = self._hbm_bytes(resource) if resource.gpu else (0, "")
        return Cluster(
            nodes=min_nodes,
            nproc_per_node=nproc,
            device="cuda" if resource.gpu else "cpu",
            hbm_per_rank=hbm,
            ddr_per_rank=resource.memMB * MiB // nproc,
            node=self.h or f"a node of {resource.gpu} GPUs and {resource.memMB} MB",
            hbm_source=hbm_source,
        )

    def _hbm_bytes(self, resource: specs.Resource) -> tuple[int, str]:
        """The HBM per rank: --hbm_gb, else that of the -h type's GPU, else (--gpu without -h)
        that of this machine's GPU 0, where the training job's planner reads it too
        (apps/core/training/sharding.py); with where it came from, when read here."""
        hbm_gib = self.hbm_gb or known_hbm_gib(resource)
        if hbm_gib:
            return int(hbm_gib * GiB), ""
        gpu = None if self.h else local_gpu()
        if gpu is not None:
            return (
                gpu.total_bytes,
                f"GPU memory: {gpu.total_bytes / GiB:.2f} GiB, read from this machine's GPU 0 ({gpu.name})",
            )
        instance_type = resource.capabilities.get(K8S_ITYPE, "")
        node = f"-h {self.h} ({instance_type or 'no instance type'})" if self.h else f"--gpu {self.gpu}"
        raise ConfigError(
            f"how much memory a GPU of {node} has is not known: give it with --hbm_gb "
            "(e.g. --hbm_gb 79 for an H100 80 GB, which has 79.1 GiB)"
        )


@dataclass(frozen=True)
class LocalGpu:
    name: str  # as CUDA names it: "NVIDIA H200"
    total_bytes: int


def local_gpu() -> LocalGpu | None:
    """This machine's first CUDA GPU, as torch sees it (its whole memory, as the training job
    plans with it); None where torch sees none. Imports torch only when called."""
    import torch  # here: only a job of --gpu GPUs whose memory no option gives asks

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return LocalGpu(properties.name, properties.total_memory)


def known_hbm_gib(resource: specs.Resource) -> int | None:
    """The nominal HBM of one GPU of ``resource``'s instance type, where GPU_HBM_GIB has it."""
    instance_type = resource.capabilities.get(K8S_ITYPE, "")
    return GPU_HBM_GIB.get(instance_type) or GPU_HBM_GIB.get(instance_type.split(".")[0])


def check_hbm_gb(hbm_gb: float, resource: specs.Resource, h: str | None) -> None:
    """Refuses the --hbm_gb that the training job would refuse at start-up, before it is submitted:
    any on nodes without GPUs, and more than the GPU of the -h type has (the job compares it with
    the GPU's real memory, apps/core/training/sharding.py ``hbm_per_rank``)."""
    if not hbm_gb:
        return
    if not resource.gpu:
        raise ConfigError(
            f"--hbm_gb {hbm_gb:g} is for GPU nodes, but the job's nodes have no GPUs: give "
            "-h with GPUs (e.g. aws_p4d.24xlarge) or --gpu, or drop --hbm_gb"
        )
    known = known_hbm_gib(resource)
    if known and hbm_gb > known:
        raise ConfigError(
            f"--hbm_gb {hbm_gb:g} is more than the {known} GiB of a GPU of -h {h}, so the job "
            "would refuse it: give less, or 0 to plan with the whole GPU"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"
