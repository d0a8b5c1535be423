"""The grammar of a job's shape, ``-j`` and ``-h``, and the checks between them.

Shared by the components (``components/launch.py``, which builds the job) and the app's planner
(:mod:`apps.core.launch.target`, which plans for it), so that a job size is read and refused the same
way by both. Needs neither torch nor a GPU: components import it to check their arguments cheaply.
Dependencies point one way: components import this module, never the other way round.
"""

import re
from dataclasses import dataclass, field

from torchx import specs

from apps.core.common.errors import ConfigError

_JOB_SIZE = re.compile(r"^(?:(?P<min>\d+):)?(?P<nodes>\d+)(?:x(?P<nproc>\d+))?$")

#: A guard against typos rather than a tuning: more processes per node than any node has GPUs
#: or CPU cores, which local_cwd would all start on this machine.
MAX_NPROC_PER_NODE = 1024


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
class JobShape:
    """``-j`` and ``-h`` (or ``--gpu`` without ``-h``), checked against each other on creation:
    at most one process per GPU, and a process count wherever none can be inferred."""

    j: str
    h: str | None = None
    gpu: int = 0
    job_size: JobSize = field(init=False)
    #: The ``-h`` instance type; None without ``-h``.
    resource: specs.Resource | None = field(init=False)

    def __post_init__(self) -> None:
        if self.gpu < 0:
            raise ConfigError(f"--gpu {self.gpu} must be 0 or more")
        self.job_size = parse_job_size(self.j)
        self.resource = self._named_resource() if self.h else None
        self._check_processes_per_node()

    def _named_resource(self) -> specs.Resource:
        """The ``-h`` instance type, checked against ``-j``."""
        try:
            resource = specs.resource(h=self.h)
        except KeyError as e:
            raise ConfigError(f"-h {self.h!r} is not a known instance type. {e.args[0]}") from None
        nproc = self.job_size.nproc_per_node
        if nproc is None and not resource.gpu:
            raise ConfigError(
                f"-j {self.j!r} gives no processes per node and -h {self.h} has no GPUs to infer them "
                f"from: write -j {self.job_size.max_nodes}xNPROC_PER_NODE"
            )
        if nproc is not None and resource.gpu and nproc > resource.gpu:
            raise ConfigError(
                f"-j {self.j!r} asks for {nproc} processes per node but -h {self.h} has {resource.gpu} "
                f"GPUs: use at most one process per GPU (e.g. -j {self._with_nproc(resource.gpu)})"
            )
        return resource

    @property
    def processes_per_node(self) -> int:
        """``-j``'s processes per node; a bare ``-j``: with ``-h`` one per GPU, without it the
        processes of its one node."""
        if self.job_size.nproc_per_node is not None:
            return self.job_size.nproc_per_node
        return self.resource.gpu if self.resource else self.job_size.max_nodes

    @property
    def world_sizes(self) -> list[int]:
        """Every number of ranks the job may train on: each node count from ``-j``'s least to its
        most (an elastic job's) times the processes per node."""
        if self.job_size.nproc_per_node is None and not self.resource:
            return [self.processes_per_node]  # one node
        nodes = range(self.job_size.min_nodes, self.job_size.max_nodes + 1)
        return [count * self.processes_per_node for count in nodes]

    def _check_processes_per_node(self) -> None:
        nproc = self.processes_per_node
        if nproc > MAX_NPROC_PER_NODE:
            raise ConfigError(
                f"-j {self.j!r} starts {nproc} processes per node, more than "
                f"{MAX_NPROC_PER_NODE}: start one per GPU or CPU core (e.g. -j {self._with_nproc(8)})"
            )
        if not self.h and self.gpu and nproc > self.gpu:
            raise ConfigError(
                f"-j {self.j!r} starts {nproc} processes per node but --gpu is {self.gpu}: use at "
                f"most one process per GPU (e.g. -j {self._with_nproc(self.gpu)})"
            )

    def _with_nproc(self, nproc: int) -> str:
        """``-j`` with ``nproc`` processes per node, for advice."""
        j = self.j.strip()
        if self.job_size.nproc_per_node:
            return f"{j.rpartition('x')[0]}x{nproc}"
        return f"{j if self.h else 1}x{nproc}"  # a bare -j counts nodes with -h, processes without
