"""Offline validation of the Kubeflow jobs ``-s kubeflow`` generates: would an API server with the
operators installed take them as they are?

No API server can run here, so a job is checked against the operators' own published models, strictly:
a field a model does not declare is an error (a CRD's structural schema would prune it silently), as
are a value of the wrong type and a missing required field. The generated models themselves ignore
unknown keys, so each object is walked key by key:

- a PyTorchJob through kubeflow-training's ``KubeflowOrgV1PyTorchJob`` (openapi-generator models:
  ``attribute_map``/``openapi_types``) and, from the replica templates down, the Kubernetes client's
  ``V1PodTemplateSpec``, whose constructors refuse missing required fields;
- a TrainJob through kubeflow-trainer-api's ``TrainerV1alpha1TrainJob`` (pydantic models, with their own
  copies of the Kubernetes models), then ``from_dict`` for types and required fields.

Then the rules no schema states, from the operators' webhooks (training-operator 1.9
pytorchjob_webhook.go, trainer 2.3 torch plugin) and Kubernetes: names, replica counts, the trainer
container, reserved variables, and resource quantities (tests/volcano_validation.py); and Kubernetes'
validation of labels and volumes (label values; ConfigMap, Secret and claim names; host paths; mount
paths absolute and unique), and images without whitespace (the kubelet's InvalidImageName).
"""

from __future__ import annotations

import re
import typing
from typing import Any

import kubeflow.training.models as training_models
import kubernetes.client.models as kubernetes_models
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob, TrainerV1alpha1TrainJobStatus
from pydantic import BaseModel, ValidationError

from tests.volcano_validation import _resource_errors, label_errors

#: Container types as kubeflow-training's models (``list[X]``) and the Kubernetes client's (``List[X]``) write them.
_LIST_TYPE = re.compile(r"(?:list|List)\[(.+)\]")
_MAP_TYPE = re.compile(r"dict\(str, (.+)\)|Dict\[str, (.+)\]")
_RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
#: Kubernetes' object names (DNS-1123 subdomains, at most 253).
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_PRIMITIVES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "datetime": lambda v: isinstance(v, str),
    "date": lambda v: isinstance(v, str),
    "Quantity": lambda v: isinstance(v, (str, int)),
    "object": lambda v: True,
}
_TORCH_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def validate_pytorchjob(job: dict[str, Any]) -> list[str]:
    """Every reason the API server (with the training operator's CRD and webhook) would refuse or alter ``job``."""
    errors = _openapi_errors(job, "KubeflowOrgV1PyTorchJob", "")
    errors += _name_errors(job, "-worker-", sum(s.get("replicas", 1) for s in _replica_specs(job).values()))
    errors += label_errors(job.get("metadata", {}), "metadata")
    for replica_type, spec in _replica_specs(job).items():
        where = f"spec.pytorchReplicaSpecs.{replica_type}"
        errors += _pod_errors(spec.get("template", {}), f"{where}.template")
        if replica_type not in ("Master", "Worker"):
            errors.append(f"{where}: a PyTorchJob's replica types are Master and Worker")
        if replica_type == "Master" and spec.get("replicas") != 1:
            errors.append(f"{where}.replicas: must be 1")
        if spec.get("restartPolicy") not in ("Always", "OnFailure", "Never", "ExitCode"):
            errors.append(f"{where}.restartPolicy: {spec.get('restartPolicy')!r} is not a restart policy")
        containers = spec.get("template", {}).get("spec", {}).get("containers", [])
        if "pytorch" not in [c.get("name") for c in containers]:
            errors.append(f"{where}: must have a container named pytorch")
        for i, container in enumerate(containers):
            if not container.get("image"):  # optional in a pod, not here
                errors.append(f"{where}.template.spec.containers[{i}].image: must be required")
            errors += [f"{where} container {container.get('name')}: {e}" for e in _resource_errors(container)]
    if "elasticPolicy" in job.get("spec", {}) and "Worker" not in _replica_specs(job):
        errors.append("spec.pytorchReplicaSpecs.Worker: must be configured if elastic policy is used")
    return errors


def validate_trainjob(job: dict[str, Any]) -> list[str]:
    """Every reason the API server (with Kubeflow Trainer's CRDs and webhook) would refuse or alter ``job``."""
    errors = _pydantic_model_errors(job, TrainerV1alpha1TrainJob)
    trainer = job.get("spec", {}).get("trainer", {})
    if isinstance(trainer.get("numNodes", 1), int):  # else from_dict said so
        errors += _name_errors(job, "-node-0-", trainer.get("numNodes", 1))
    errors += label_errors(job.get("metadata", {}), "metadata")
    for i, patch in enumerate(job.get("spec", {}).get("runtimePatches", [])):
        for j, replicated in enumerate(
            patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
        ):
            where = (
                f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}].template.spec.template"
            )
            errors += _pod_errors(replicated.get("template", {}).get("spec", {}).get("template", {}), where)
    if not re.fullmatch(r"\S+", trainer.get("image", "")):
        errors.append(f"spec.trainer.image {trainer.get('image')!r}: the kubelet refuses it (InvalidImageName)")
    reserved = sorted({env.get("name") for env in trainer.get("env", [])} & _TORCH_RESERVED_ENV)
    if reserved:
        errors.append(f"spec.trainer.env: must not have reserved envs {reserved}")
    resources = {"resources": trainer.get("resourcesPerNode", {})}
    errors += [f"spec.trainer.resourcesPerNode: {e}" for e in _resource_errors(resources)]
    managers = [patch.get("manager") for patch in job.get("spec", {}).get("runtimePatches", [])]
    if len(managers) != len(set(managers)):
        errors.append(f"spec.runtimePatches: managers must be unique, got {managers}")
    return errors


def validate_recorded(response: dict[str, Any], kind: str) -> list[str]:
    """Errors of an operator's response replayed in the tests (tests/kubeflow_responses/): its job
    ``status`` against the kind's model (``PyTorchJob`` or ``TrainJob``), its pods against ``V1Pod``."""
    if kind == "PyTorchJob":
        errors = _openapi_errors(response["status"], "KubeflowOrgV1JobStatus", "status")
    else:
        errors = [f"status.{e}" for e in _pydantic_model_errors(response["status"], TrainerV1alpha1TrainJobStatus)]
    for i, pod in enumerate(response.get("pods", [])):
        errors += _openapi_errors(pod, "V1Pod", f"pods[{i}]")
    return errors


def _pydantic_model_errors(value: dict[str, Any], model: type[BaseModel]) -> list[str]:
    """Unknown keys first (pydantic would drop them), then pydantic's own checks of types and required fields."""
    errors = _pydantic_errors(value, model, "")
    if not errors:
        try:
            model.from_dict(value)
        except ValidationError as e:
            errors += [f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in e.errors()]
    return errors


def _replica_specs(job: dict[str, Any]) -> dict[str, Any]:
    return job.get("spec", {}).get("pytorchReplicaSpecs") or {}


def _name_errors(job: dict[str, Any], pod_infix: str, replicas: int) -> list[str]:
    """The job's name is an RFC 1035 label (both webhooks), and so is its last pod's hostname."""
    name = job.get("metadata", {}).get("name", "")
    errors = []
    if not _RFC1035_LABEL.fullmatch(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not an RFC 1035 label")
    hostname = f"{name}{pod_infix}{replicas - 1}"
    if len(hostname) > 63:
        errors.append(f"pod hostname {hostname!r} is longer than 63 characters")
    return errors


def _pod_errors(template: dict[str, Any], where: str) -> list[str]:
    """Kubernetes' validation of a pod template's labels, volumes and mounts, and the kubelet's of its images."""
    errors = label_errors(template.get("metadata", {}), f"{where}.metadata")
    spec = template.get("spec", {})
    for volume in spec.get("volumes") or []:
        names = [
            volume.get("configMap", {}).get("name"),
            volume.get("secret", {}).get("secretName"),
            volume.get("persistentVolumeClaim", {}).get("claimName"),
        ]
        for name in [n for n in names if n is not None]:
            if len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
                errors.append(f"{where}.spec.volumes[{volume.get('name')}]: {name!r} is not a DNS-1123 subdomain")
        path = volume.get("hostPath", {}).get("path")
        if path is not None and (not path.startswith("/") or ".." in path.split("/")):
            errors.append(f"{where}.spec.volumes[{volume.get('name')}].hostPath.path {path!r}: must not contain '..'")
    for container in spec.get("containers") or []:
        if "image" in container and not re.fullmatch(r"\S+", container["image"]):
            errors.append(f"{where} container {container.get('name')}: image {container['image']!r} (InvalidImageName)")
        paths = [mount.get("mountPath", "") for mount in container.get("volumeMounts") or []]
        errors += [
            f"{where} container {container.get('name')}: mountPath {p!r} is not absolute"
            for p in paths
            if not p.startswith("/")
        ]
        errors += [
            f"{where} container {container.get('name')}: mountPath {p!r} must be unique"
            for p in set(paths)
            if paths.count(p) > 1
        ]
    return errors


def _openapi_errors(value: Any, type_name: str, path: str) -> list[str]:
    """``value`` checked against an openapi-generator model type (kubeflow-training's or the Kubernetes client's)."""
    if match := _LIST_TYPE.fullmatch(type_name):
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, item in enumerate(value) for e in _openapi_errors(item, match[1], f"{path}[{i}]")]
    if match := _MAP_TYPE.fullmatch(type_name):
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not a map"]
        item_type = match[1] or match[2]
        return [e for key, item in value.items() for e in _openapi_errors(item, item_type, _at(path, key))]
    if type_name in _PRIMITIVES:
        return [] if _PRIMITIVES[type_name](value) else [f"{path}: {value!r} is not of type {type_name}"]
    model = getattr(training_models, type_name, None) or getattr(kubernetes_models, type_name)
    if not isinstance(value, dict):
        return [f"{path}: {value!r} is not a {type_name} object"]
    attributes = {key: attribute for attribute, key in model.attribute_map.items()}
    errors = [f"{_at(path, key)}: {type_name} has no such field" for key in value if key not in attributes]
    for key, attribute in attributes.items():
        if key in value:
            errors += _openapi_errors(value[key], model.openapi_types[attribute], _at(path, key))
    if not errors:
        try:  # the constructors refuse a missing required field (the Kubernetes client's, a wrong type too)
            model(**{attributes[key]: item for key, item in value.items()})
        except ValidationError as e:
            errors += [f"{_at(path, '.'.join(map(str, error['loc'])))}: {error['msg']}" for error in e.errors()]
        except ValueError as e:
            errors.append(f"{path or '<job>'}: {e}")
    return errors


def _pydantic_errors(value: Any, annotation: Any, path: str) -> list[str]:
    """Unknown keys in ``value``, checked against a pydantic model type (pydantic ignores them)."""
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin is list and isinstance(value, list):
        (item_type,) = typing.get_args(annotation)
        return [e for i, item in enumerate(value) for e in _pydantic_errors(item, item_type, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        _, item_type = typing.get_args(annotation)
        return [e for key, item in value.items() for e in _pydantic_errors(item, item_type, _at(path, key))]
    # oneOf wrappers (quantities, int-or-string) hold a plain value, which from_dict checks.
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    if not is_model or "actual_instance" in annotation.model_fields:
        return []
    if not isinstance(value, dict):
        return [f"{path}: {value!r} is not a {annotation.__name__} object"]
    fields = {field.alias or name: field for name, field in annotation.model_fields.items()}
    errors = [f"{_at(path, key)}: {annotation.__name__} has no such field" for key in value if key not in fields]
    for key, field in fields.items():
        if key in value:
            errors += _pydantic_errors(value[key], field.annotation, _at(path, key))
    return errors


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unwrap(annotation: Any) -> Any:
    """``X`` of ``Optional[X]``; other unions are of plain values, left as they are."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return args[0]
    return annotation
