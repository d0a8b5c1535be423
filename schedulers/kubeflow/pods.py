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
- labels: TorchX's, less the replica id, as one template serves many replicas, made label values
  (TorchX ends a job name's label in '.' where ``--name`` ends in '-', '_' or '.': refused by the API);
- the image and the mounts, which ``role_to_pod`` copies as they are: checked first (``check_role``).
"""

from __future__ import annotations

import posixpath
import re
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
from torchx.specs import AppDef, BindMount, DeviceMount, Role, VolumeMount

from schedulers.kube_labels import label_value
from schedulers.kubeflow.kinds import UnsupportedAppError
from schedulers.kubeflow.options import DNS_SUBDOMAIN, SUBDOMAIN_HINT, KubeflowOpts

#: ``src`` prefixes of ``type=volume`` mounts that mount a ConfigMap or a Secret as files.
CONFIGMAP = "configmap:"
SECRET = "secret:"
#: Where ``role_to_pod`` mounts every pod's memory-backed /dev/shm.
SHM_PATH = "/dev/shm"

#: A container image reference, as the distribution spec's grammar (reference.go) has it:
#: ``[HOST[:PORT]/]PATH[:TAG][@DIGEST]``.
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_PART}(?:/{_PATH_PART})*(?::\w[\w.-]{{0,127}})?(?:@{_DIGEST})?"
)
#: What a label value may not hold (the rest: at most 63, a letter or digit at each end).


def pod_template(
    app: AppDef, role: Role, job_name: str, container: str, restart_policy: str | None, cfg: KubeflowOpts
) -> dict[str, Any]:
    """The pod template (as the API's JSON) that each replica of ``role`` (macros applied) runs;
    ``restart_policy`` None leaves it to the runtime."""
    check_role(role)
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
    pod.metadata.labels = {key: label_value(value) for key, value in {**pod.metadata.labels, **labels}.items()}
    return sanitize_for_serialization(V1PodTemplateSpec(metadata=pod.metadata, spec=pod.spec))


def check_role(role: Role) -> None:
    """Refuses, naming the value and the fix, an image or mounts that the API server would refuse in a
    pod, or that the node would fail to start it with."""
    if not IMAGE_REFERENCE.fullmatch(role.image):
        raise UnsupportedAppError(
            f"--image {role.image!r} is not a container image reference: use [REGISTRY/]REPOSITORY[:TAG][@DIGEST] "
            "without spaces (e.g. registry.example.com/torchrec-dlrm:latest)"
        )
    mounted = {SHM_PATH: "the pod's memory-backed /dev/shm"}
    for mount in role.mounts:
        source = _checked_source(mount)
        if not posixpath.isabs(mount.dst_path):
            raise UnsupportedAppError(
                f"--mounts dst={mount.dst_path!r} is not an absolute path in the container: give one such as /data"
            )
        destination = posixpath.normpath(mount.dst_path)
        if destination in mounted:
            raise UnsupportedAppError(
                f"--mounts dst={mount.dst_path} is mounted twice ({mounted[destination]} and src={source}): give "
                "each mount a dst of its own"
            )
        mounted[destination] = f"src={source}"


def _checked_source(mount: BindMount | VolumeMount | DeviceMount) -> str:
    """The mount's source, refused where it is not a name (ConfigMap, Secret, claim) or host path the API takes."""
    if not isinstance(mount, VolumeMount):
        if not posixpath.isabs(mount.src_path) or ".." in mount.src_path.split("/"):
            raise UnsupportedAppError(
                f"--mounts src={mount.src_path!r} is not a host path the API takes: give an absolute path without '..'"
            )
        return mount.src_path
    kind, name = _volume_source(mount.src)
    if not DNS_SUBDOMAIN.fullmatch(name):
        raise UnsupportedAppError(f"--mounts src={mount.src!r}: {name!r} is not a {kind}'s name: use {SUBDOMAIN_HINT}")
    return mount.src


def _volume_source(src: str) -> tuple[str, str]:
    """(kind, name) of what a ``type=volume`` mount's ``src`` names: a ConfigMap, a Secret, else a claim."""
    for prefix, kind in ((CONFIGMAP, "ConfigMap"), (SECRET, "Secret")):
        if src.startswith(prefix):
            return kind, src.removeprefix(prefix)
    return "PersistentVolumeClaim", src


def _file_volume(name: str, src: str) -> V1Volume:
    kind, source = _volume_source(src)
    if kind == "ConfigMap":
        return V1Volume(name=name, config_map=V1ConfigMapVolumeSource(name=source))
    return V1Volume(name=name, secret=V1SecretVolumeSource(secret_name=source))
