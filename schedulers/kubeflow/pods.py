"""The pod template of a role's replicas, for both Kubeflow job kinds.

TorchX's ``role_to_pod`` (torchx.schedulers.kubernetes_scheduler) builds it as designed: limits and
requests from the role's resource (GPUs as ``nvidia.com/gpu``, a named resource's devices such as EFA
interfaces as ``vpc.amazonaws.com/efa``, a little CPU and memory left to the kubelet), the ``-h``
instance type as a ``node.kubernetes.io/instance-type`` node selector, a memory-backed ``/dev/shm``
(data loader workers share batches through it; the container runtime's default is 64 MiB), host-path,
PersistentVolumeClaim and device mounts, the environment and the service account. Wrapped here, where
it does not fit Kubeflow's operators:

- the container's name is the operator's (``pytorch`` for a PyTorchJob, ``node`` for a TrainJob),
  which they look the trainer container up by;
- ``restartPolicy``: TorchX writes ``Never``; the template here says what the operator will apply;
- ConfigMaps and Secrets as files (``type=volume,src=configmap:NAME,dst=PATH`` or ``src=secret:NAME``),
  which TorchX would turn into claims of a PersistentVolumeClaim named ``configmap:NAME``;
- image pull secrets and the pods' PriorityClass, which ``role_to_pod`` takes no argument for;
- labels: TorchX's, less the replica id, as one template serves many replicas.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kubernetes.client.models import (
    V1ConfigMapVolumeSource,
    V1LocalObjectReference,
    V1PodTemplateSpec,
    V1SecretVolumeSource,
    V1Volume,
    V1VolumeMount,
)
from torchx.schedulers.kubernetes_scheduler import (
    LABEL_REPLICA_ID,
    pod_labels,
    role_to_pod,
    sanitize_for_serialization,
)
from torchx.specs import AppDef, Role, VolumeMount

from schedulers.kubeflow.options import KubeflowOpts

#: ``src`` prefixes of ``type=volume`` mounts that mount a ConfigMap or a Secret as files.
CONFIGMAP = "configmap:"
SECRET = "secret:"


def pod_template(
    app: AppDef, role: Role, job_name: str, container: str, restart_policy: str | None, cfg: KubeflowOpts
) -> dict[str, Any]:
    """The pod template (as the API's JSON) that each replica of ``role`` (macros applied) runs;
    ``restart_policy`` None leaves it to the runtime."""
    file_mounts = [m for m in role.mounts if isinstance(m, VolumeMount) and m.src.startswith((CONFIGMAP, SECRET))]
    other_mounts = [m for m in role.mounts if m not in file_mounts]
    pod = role_to_pod(container, replace(role, mounts=other_mounts), cfg.service_account)
    pod.spec.restart_policy = restart_policy
    pod.spec.priority_class_name = cfg.priority_class
    secrets = cfg.image_pull_secrets or []
    pod.spec.image_pull_secrets = [V1LocalObjectReference(name=secret) for secret in secrets] or None
    (trainer,) = pod.spec.containers
    for i, mount in enumerate(file_mounts, start=len(other_mounts)):
        name = f"mount-{i}"  # role_to_pod's naming, continued
        pod.spec.volumes.append(_file_volume(name, mount.src))
        trainer.volume_mounts.append(V1VolumeMount(name=name, mount_path=mount.dst_path, read_only=mount.read_only))
    role_index = [r.name for r in app.roles].index(role.name)
    labels = pod_labels(app=app, role_idx=role_index, role=role, replica_id=0, app_id=job_name)
    del labels[LABEL_REPLICA_ID]
    pod.metadata.labels.update(labels)
    return sanitize_for_serialization(V1PodTemplateSpec(metadata=pod.metadata, spec=pod.spec))


def _file_volume(name: str, src: str) -> V1Volume:
    if src.startswith(CONFIGMAP):
        return V1Volume(name=name, config_map=V1ConfigMapVolumeSource(name=src.removeprefix(CONFIGMAP)))
    return V1Volume(name=name, secret=V1SecretVolumeSource(secret_name=src.removeprefix(SECRET)))
