"""Offline validation of a Volcano Job: what a Kubernetes API server with Volcano would check.

No API server can run here, so a generated job is checked against

- a JSON Schema of the Volcano Job API's fields (tests/schemas/volcano_job_v1alpha1.yaml, see its
  README), in which a field the API does not declare is an error: the API server would silently
  prune it;
- the official Kubernetes client's models: every task's pod template must deserialize into
  ``V1PodTemplateSpec`` (which refuses missing required fields) and serialize back unchanged,
  so no field is unknown to Kubernetes or of the wrong type;
- label values, the job's and its pods' (:func:`label_errors`: TorchX writes the app's name into
  them);
- the lifecycle policies as Volcano's admission webhook checks them (:func:`policy_errors`): each
  an event (or events) or an exit code, never both nor neither, a non-zero exit code, an action
  users may give, no event or exit code twice in one list;
- the pod rules neither schema expresses that a GPU job can break: resource quantities parse,
  requests do not exceed limits, extended resources (GPUs, EFA) are whole numbers with
  request equal to limit, and names fit Kubernetes' limits (the 63-character pod name check
  is TorchX's own, skipped when a dry run cannot reach a cluster).
"""

import functools
import json
import os
import re
from decimal import Decimal
from typing import Any

import jsonschema
import yaml
from kubernetes.client import ApiClient
from kubernetes.utils import parse_quantity

SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas", "volcano_job_v1alpha1.yaml")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Kubernetes' label values: at most 63 characters, a letter or digit at each end.
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# Resources the kubelet can overcommit; every other (nvidia.com/gpu, vpc.amazonaws.com/efa,
# hugepages) must be requested whole and exactly at its limit.
_OVERCOMMITTABLE = {"cpu", "memory", "ephemeral-storage"}


def validate_volcano_job(job: dict[str, Any]) -> list[str]:
    """Every reason a Kubernetes API server with Volcano would refuse or alter ``job``; [] if none."""
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<job>'}: {error.message}"
        for error in _validator().iter_errors(job)
    ]
    name = job.get("metadata", {}).get("name", "")
    if not _DNS_LABEL.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1123 label")
    errors += label_errors(job.get("metadata", {}), "metadata")
    errors += policy_errors(job.get("spec", {}).get("policies", []), "spec.policies")
    for i, task in enumerate(job.get("spec", {}).get("tasks", [])):
        where = f"spec.tasks.{i}"
        errors += policy_errors(task.get("policies", []), f"{where}.policies")
        errors += label_errors(task.get("template", {}).get("metadata", {}), f"{where}.template.metadata")
        pod_name = f"{name}-{task.get('name')}-{task.get('replicas', 1) - 1}"
        if len(pod_name) > 63:
            errors.append(f"{where}: pod name {pod_name!r} is longer than 63 characters")
        errors += [f"{where}.template: {e}" for e in _pod_template_errors(task.get("template", {}))]
    return errors


#: The actions Volcano's webhook lets a policy give (its policyActionMap's allowed ones).
_POLICY_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "TerminateJob", "CompleteJob", "ResumeJob"}


def policy_errors(policies: list[dict[str, Any]], where: str) -> list[str]:
    """Why Volcano's admission webhook would refuse a list of lifecycle policies (its
    validatePolicies, which applies them in order: a task's first matching policy wins)."""
    errors, events, exit_codes = [], set(), set()
    for i, policy in enumerate(policies):
        named = [policy["event"]] if policy.get("event") else list(policy.get("events", []))
        code = policy.get("exitCode")
        if named and code is not None:
            errors.append(f"{where}.{i}: must not specify event and exitCode simultaneously")
        elif not named and code is None:
            errors.append(f"{where}.{i}: either event and exitCode should be specified")
        elif code is not None:
            errors += [f"{where}.{i}: 0 is not a valid error code"] if code == 0 else []
            errors += [f"{where}.{i}: duplicate exitCode {code}"] if code in exit_codes else []
            exit_codes.add(code)
        else:
            errors += [f"{where}.{i}: duplicate event {event}" for event in named if event in events]
            events.update(named)
        if policy.get("action") not in _POLICY_ACTIONS:
            errors.append(f"{where}.{i}: invalid policy action {policy.get('action')!r}")
    return errors


def label_errors(metadata: dict[str, Any], where: str) -> list[str]:
    """The labels of ``metadata`` (at ``where``) whose values the API server refuses."""
    return [
        f"{where}.labels[{key}]: {value!r} is not a label value"
        for key, value in (metadata.get("labels") or {}).items()
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value)
    ]


@functools.cache
def _validator() -> jsonschema.Validator:
    with open(SCHEMA) as f:
        return jsonschema.Draft7Validator(yaml.safe_load(f))


def _pod_template_errors(template: dict[str, Any]) -> list[str]:
    api = ApiClient()
    try:
        model = api.deserialize(json.dumps(template), "V1PodTemplateSpec", "application/json")
    except (ValueError, TypeError) as e:  # the models refuse a missing required field
        return [f"not a V1PodTemplateSpec: {e}"]
    errors = []
    round_trip = api.sanitize_for_serialization(model)
    if round_trip != template:
        errors.append(
            "changes in a round trip through V1PodTemplateSpec (unknown fields or wrong types): "
            f"{_difference(template, round_trip)}"
        )
    for container in template.get("spec", {}).get("containers", []):
        errors += [f"container {container.get('name')}: {e}" for e in _resource_errors(container)]
    return errors


def _resource_errors(container: dict[str, Any]) -> list[str]:
    resources = container.get("resources", {})
    quantities: dict[str, dict[str, Decimal]] = {}
    errors = []
    for kind in ("requests", "limits"):
        for resource, text in resources.get(kind, {}).items():
            try:
                quantities.setdefault(kind, {})[resource] = parse_quantity(text)
            except ValueError:
                errors.append(f"{kind}.{resource} {text!r} is not a Kubernetes quantity")
    requests, limits = quantities.get("requests", {}), quantities.get("limits", {})
    for resource, request in requests.items():
        if resource in limits and request > limits[resource]:
            errors.append(f"requests.{resource} {request} exceeds limits.{resource} {limits[resource]}")
    for resource in (set(requests) | set(limits)) - _OVERCOMMITTABLE:
        values = [q[resource] for q in (requests, limits) if resource in q]
        if any(v != v.to_integral_value() for v in values):
            errors.append(f"{resource} must be a whole number, got {values}")
        if len(values) == 2 and values[0] != values[1]:
            errors.append(f"requests.{resource} {values[0]} must equal limits.{resource} {values[1]}")
    return errors


def _difference(expected: Any, actual: Any, path: str = "") -> str:
    """The first place where two JSON values differ, for a readable error."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in expected.keys() | actual.keys():
            if expected.get(key) != actual.get(key):
                return _difference(expected.get(key), actual.get(key), f"{path}.{key}")
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        for i, (e, a) in enumerate(zip(expected, actual)):
            if e != a:
                return _difference(e, a, f"{path}[{i}]")
    return f"{path.lstrip('.') or '<template>'}: {expected!r} became {actual!r}"
