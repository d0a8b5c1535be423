"""Registers ``-s kubeflow`` (schedulers/kubeflow/: Kubeflow PyTorchJob / TrainJob, with Kueue) with
TorchX's plugin registry."""

from typing import TYPE_CHECKING

from torchx.plugins import register

if TYPE_CHECKING:
    from schedulers.kubeflow.scheduler import KubeflowScheduler


@register.scheduler(name="kubeflow")
def kubeflow(session_name: str, **kwargs: object) -> "KubeflowScheduler":
    # Imported on use: TorchX imports every plugin module whenever it lists the schedulers (every
    # `torchx` command), and the Kubernetes client adds about 0.5 s to each.
    from schedulers.kubeflow.scheduler import create_scheduler

    return create_scheduler(session_name, **kwargs)
