"""A GPU node asked for with a laptop's CPUs and memory is refused by the cluster schedulers.

The components' ``--cpu 2 --memMB 8192`` suit ``-s local_cwd``, which starts processes here and
requests nothing. On a cluster they are each node's request: ``-j 2x8 --gpu 8`` would get eight
GPUs beside two CPUs and 8 GB, too little to feed them or to hold the host-side state. Only the
component knows that the two were left at their defaults, so it marks such a role
(:data:`DEFAULT_HOST_REQUEST`); each cluster scheduler refuses a marked role before anything is
built or submitted (:class:`NodeRequestCheck`), which ``--dryrun`` runs too.
"""

from typing import TYPE_CHECKING, Any, TypeAlias

from torchx.schedulers.api import Scheduler
from torchx.specs import AppDef
from torchx.specs.finder import ComponentValidationException

#: Role metadata the components set on a role with GPUs: which of cpu and memMB are the defaults.
DEFAULT_HOST_REQUEST = "dlrm/default_host_request"


class NodeRequestError(ComponentValidationException):
    """A node request a cluster cannot run the job with; ``torchx run`` prints the message alone."""


def check_node_request(app: AppDef, scheduler: str) -> None:
    """Refuses a role marked :data:`DEFAULT_HOST_REQUEST`, naming the request and the fix."""
    for role in app.roles:
        defaulted = role.metadata.get(DEFAULT_HOST_REQUEST)
        if defaulted:
            values = " and ".join(f"--{name} {getattr(role.resource, name)}" for name in defaulted.split(","))
            raise NodeRequestError(
                f"-s {scheduler}: --gpu {role.resource.gpu} asks each node for {role.resource.gpu} GPUs "
                f"with {values}, defaults sized for -s local_cwd: give -h with the nodes' instance type "
                "(e.g. -h aws_p4d.24xlarge), or the nodes' --cpu and --memMB (e.g. --cpu 64 --memMB 500000)"
            )


if TYPE_CHECKING:
    _Base: TypeAlias = Scheduler[Any]
else:  # TorchX reads a scheduler's run options' type from its first Scheduler[...] base
    _Base = object


class NodeRequestCheck(_Base):
    """Mixin of a cluster scheduler (before its Scheduler base): a marked role is refused first
    thing in its ``_pre_build_validate``, before any build or submission."""

    def _pre_build_validate(self, app: AppDef, scheduler: str, cfg: Any) -> None:
        check_node_request(app, scheduler)
        super()._pre_build_validate(app, scheduler, cfg)
