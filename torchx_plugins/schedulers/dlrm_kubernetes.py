"""Registers ``-s kubernetes`` as schedulers/kubernetes.py's KubernetesScheduler: TorchX's own, whose dry
run needs neither Docker nor a cluster (a registered scheduler replaces the built-in one of the same name)."""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from schedulers.kubernetes import KubernetesScheduler


@register.scheduler(name="kubernetes")
def kubernetes(session_name: str, **kwargs: object) -> "KubernetesScheduler":
    # Imported on use: TorchX imports every plugin module whenever it lists the schedulers (every
    # `torchx` command), and the Kubernetes client adds about 0.5 s to each.
    from schedulers.kubernetes import create_scheduler

    return create_scheduler(session_name, **kwargs)
