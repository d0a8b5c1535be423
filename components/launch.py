"""Where and how a role runs: the launcher arguments every app's components share.

The job's name is the app's: each app's components declare :class:`Launch` with its name as the
default (:func:`named_after`), so that its jobs, and their run folders, are named after it."""

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from torchx import specs
from torchx.components import dist, utils
from torchx.specs.named_resources_aws import EFA_DEVICE, K8S_ITYPE

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections
from apps.core.launch.job_shape import JobShape
from apps.core.launch.target import PlanTarget
from apps.core.options import Options, option, to_argv
from apps.core.training.app_spec import AppSpec
from apps.core.training.run_folder import TORCHRUN_LOGS, output_folder
from schedulers.metadata import LOG_DIR
from schedulers.node_request import DEFAULT_HOST_REQUEST

#: The image built by the repository's Dockerfile (``docker build -t torchrec-dlrm .``): the
#: project's, which holds every app.
DEFAULT_IMAGE = "torchrec-dlrm:latest"

#: Environment every trainer gets; the user's ``env`` is merged over it.
DEFAULT_ENV = {
    # Log lines reach `torchx log` as they are written, not when a buffer fills.
    "PYTHONUNBUFFERED": "1",
    # A failed or timed-out NCCL collective aborts the rank instead of hanging the job, so
    # torchrun (max_retries) or the scheduler can restart it from the last checkpoint.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_DEBUG": "WARN",
    # torchrun restarts (max_retries) otherwise reuse the rendezvous TCPStore, where restarted
    # trainers can read the previous attempt's gloo/NCCL addresses and fail to connect
    # (pytorch/pytorch#135712; seen here as "Gloo connectFullMesh failed ... Connection refused").
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}

#: NCCL over EFA (reference document 004), for an ``-h`` AWS instance type with GPUs and EFA
#: interfaces; merged over DEFAULT_ENV and under the user's ``env``. Left out of the document's
#: list: NCCL_DEBUG=INFO (a debugging level; pass --env NCCL_DEBUG=INFO) and NCCL_IB_DISABLE=0
#: (NCCL's default; EFA reaches NCCL through the aws-ofi-nccl plugin, not InfiniBand verbs).
EFA_ENV = {
    # libfabric (aws-ofi-nccl) must use the EFA provider, not fall back to TCP.
    "FI_PROVIDER": "efa",
    # NCCL's low-latency protocols (LL, LL128) assume each 8- or 128-byte line lands whole and
    # in order; EFA's RDMA writes do not promise that.
    "NCCL_PROTO": "simple",
}
#: Added where EFA can read and write GPU memory directly (GPUDirect RDMA); libfabric refuses
#: FI_EFA_USE_DEVICE_RDMA=1 on instance types without it (p3dn, g5, ...). NCCL_NET_GDR_LEVEL=2
#: (PXB): use it between a GPU and a NIC behind the same PCIe switch.
EFA_RDMA_ENV = {"FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET_GDR_LEVEL": "2"}
EFA_RDMA_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300", "p6e-gb200"})

#: Job names: RUN, EXPERIMENT/RUN, /RUN or EXPERIMENT/, as TorchX reads them. Schedulers put the name in job names, log
#: folders, scripts and variable lists (sbatch's --export is comma separated), so each part is
#: letters, digits, '_', '-' and '.', the characters all of them take as they are.
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_JOB_NAME = re.compile(rf"(?:{_NAME_PART})?/?{_NAME_PART}|{_NAME_PART}/")
#: Schedulers add a unique suffix to the name, and a folder name has at most 255 bytes.
MAX_NAME_LENGTH = 100

#: Names that every shell and scheduler passes on as environment variables.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


#: The help of --name, whose default each app gives (:func:`named_after`).
NAME_HELP = "Job name: {experiment}/{run}, {experiment}/ or {run}."


@dataclass
class Launch:
    name: str = dataclasses.field(metadata={"help": NAME_HELP, "choices": None})  # the app's: named_after
    image: str = option(
        DEFAULT_IMAGE,
        "Container image with this project installed (ignored by local_cwd, which runs in the current directory).",
    )
    j: str = option(
        "1x2",
        "Job size: NNODESxNPROC_PER_NODE (e.g. 2x8), MIN:MAXxNPROC_PER_NODE for an elastic "
        "job, or NPROC for one node (with -h: a node count, one process per GPU).",
    )
    h: str | None = option(
        None,
        "Named resource of each node (e.g. aws_p4d.24xlarge); takes precedence over cpu, gpu and memMB.",
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
        "Times failed trainers are restarted: torchrun restarts them in place, and schedulers "
        "that support retries reschedule the job; each restart resumes from the newest "
        "checkpoint in --checkpoint_dir.",
    )
    rdzv_port: int = option(29500, "Port of the rendezvous on the first node (multi-node jobs).")

    def __post_init__(self) -> None:
        shape = JobShape(self.j, self.h, self.gpu)  # -j, -h and --gpu, as the planner reads them
        self.job_size, self.resource, self.world_sizes = shape.job_size, shape.resource, shape.world_sizes
        for name in ("cpu", "memMB"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} {getattr(self, name)} must be positive")
        if self.max_retries < 0:
            raise ConfigError(f"--max_retries {self.max_retries} must be 0 or more")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"--rdzv_port {self.rdzv_port} is not a TCP port: use one of 1-65535")
        self._check_name()
        self._check_env()
        self._check_mounts()

    def _check_name(self) -> None:
        if len(self.name) > MAX_NAME_LENGTH or not _JOB_NAME.fullmatch(self.name):
            raise ConfigError(
                f"--name {self.name!r} is not a job name: use RUN, EXPERIMENT/RUN or EXPERIMENT/, "
                "each of letters, digits, '_', '-' and '.' starting with a letter or digit, at "
                f"most {MAX_NAME_LENGTH} characters in all (e.g. --name ctr/dlrm-run1)"
            )

    def _check_env(self) -> None:
        for key in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise ConfigError(
                    f"--env {key!r} is not an environment variable name: use letters, digits and "
                    "'_', not starting with a digit (e.g. --env NCCL_DEBUG=INFO)"
                )

    def _check_mounts(self) -> None:
        """TorchX's own parser, whose KeyError would reach the user as a traceback."""
        try:
            specs.parse_mounts(self.mounts)
        except (KeyError, ValueError) as e:
            reason = str(e.args[0])
            raise ConfigError(
                f"--mounts {','.join(self.mounts)!r} is not a list of mounts "
                f"({reason if ' ' in reason else 'no ' + reason + '='}): use "
                "type=bind,src=/data,dst=/data[,readonly] or type=volume,src=NAME,dst=PATH, "
                "one after another"
            ) from None

    @property
    def gpus_per_node(self) -> int:
        """The GPUs each node asks for: the -h type's, else --gpu."""
        return self.resource.gpu if self.resource else self.gpu

    @property
    def instance_env(self) -> dict[str, str]:
        """NCCL/EFA settings for the ``-h`` instance type (none without one)."""
        if self.resource is None or not (self.resource.gpu and self.resource.devices.get(EFA_DEVICE)):
            return {}
        family = self.resource.capabilities.get(K8S_ITYPE, "").split(".")[0]
        return {**EFA_ENV, **(EFA_RDMA_ENV if family in EFA_RDMA_FAMILIES else {})}

    @property
    def merged_env(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.instance_env, **self.env}

    @property
    def node_args(self) -> dict[str, Any]:
        """What TorchX's app builders (``dist.torchrun``, ``utils.python``) take alike: the job's
        name, the image, and each node's resources and mounts."""
        return {
            "name": self.name,
            "image": self.image,
            "h": self.h or None,
            "cpu": self.cpu,
            "gpu": self.gpu,
            "memMB": self.memMB,
            "mounts": self.mounts or None,
        }

    def torchrun_app(self, module: str, app_args: list[str]) -> specs.AppDef:
        """The app that runs ``python -m module app_args`` under torchrun on every node.

        A method here rather than a function in components/dlrm.py: TorchX's component finder
        lists every function of a registered module that passes its linter, so a helper there
        would show up in ``torchx builtins`` as a component.
        """
        # torchrun restarts failed trainers in place as often as the scheduler may restart the job:
        # a killed process costs a restart from the newest checkpoint, not a rescheduled job.
        env = {**self.merged_env, "PET_MAX_RESTARTS": str(self.max_retries)}
        app = dist.torchrun(
            *app_args,
            m=module,
            j=self.j,
            env=env,
            max_retries=self.max_retries,
            rdzv_port=self.rdzv_port,
            **self.node_args,
        )
        (role,) = app.roles
        role.args = [*role.args[:-1], _through_our_torchrun(role.args[-1], module)]
        if self._default_host_request():
            role.metadata[DEFAULT_HOST_REQUEST] = ",".join(self._default_host_request())  # clusters refuse it
        return app

    def training_app(self, spec: AppSpec, cfg: SharedSections) -> specs.AppDef:
        """The job of an app's training (``python -m apps.<app>.train`` with ``cfg``'s options)
        under torchrun on every node, its logs beside the run's results (any app's: the folder is
        shared)."""
        app = self.torchrun_app(spec.module("train"), to_argv(cfg))
        if cfg.evaluation.output_dir:
            # The folder the run will write to (the app names it alike: app.name is the job's name that
            # TorchX gives it), for the schedulers that write logs beside the job (-s slurm). torchrun's
            # logs and error files of each attempt go into it too (PET_LOG_DIR is torchrun's --log_dir,
            # its {run} named by the app's torchrun), not to a temporary folder (on local_cwd, one that
            # TorchX deletes when the job ends).
            for role in app.roles:
                role.metadata[LOG_DIR] = output_folder(cfg.evaluation.output_dir, app.name, specs.macros.app_id)
                role.env.setdefault("PET_LOG_DIR", os.path.join(cfg.evaluation.output_dir, TORCHRUN_LOGS))
        return app

    def _default_host_request(self) -> list[str]:
        """Of --cpu and --memMB, those left at their defaults, where --gpu asks for GPU nodes."""
        if self.h or not self.gpu:
            return []
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        return [name for name in ("cpu", "memMB") if getattr(self, name) == defaults[name]]


L = TypeVar("L")


def named_after(launch: type[L], app: AppSpec) -> type[L]:
    """``launch`` (:class:`Launch`, or a part of it) for ``app``'s components: the same arguments,
    the job named after the app where the user names it not (its run folders: ``outputs/<app>-<id>``)."""
    field = ("name", str, option(app.name, NAME_HELP))
    return cast(type[L], dataclasses.make_dataclass(launch.__name__, [field], bases=(launch,)))


def _through_our_torchrun(command: str, module: str) -> str:
    """TorchX's ``torchrun ...`` command line, run instead by the torchrun command of the app whose
    ``module`` it runs (``python -m apps.dlrm.torchrun`` for ``apps.dlrm.train``: apps/core/torchrun.py).

    Same arguments; ours picks this host's address and network interface for multi-node jobs,
    which torchrun guesses from the hostname (wrongly where it resolves to loopback).
    """
    head = "torchrun "
    if not command.startswith(head):
        raise AssertionError(f"TorchX's dist.torchrun no longer starts with {head!r}: {command}")
    app = module.rsplit(".", 1)[0]
    return f"python -m {app}.torchrun " + command[len(head) :]


def plan_preview(app: AppSpec, target: PlanTarget, cfg: Options) -> specs.AppDef:
    """The job of an app's plan preview (``python -m apps.<app>.plan``): one process on any
    machine, no GPU, for the job shape ``target`` and the app's options ``cfg``."""
    return utils.python(
        *to_argv(target),
        *to_argv(cfg),
        m=app.module("plan"),
        image=DEFAULT_IMAGE,
        name=f"{app.name}-plan",
        memMB=4096,  # torch, torchrec and the planner's search on a meta-device model
    )
