"""What a Kubeflow job kind (PyTorchJob, TrainJob) is to ``-s kubeflow``: where its objects live in the
API, how an app becomes one, and how its status and pods read back as TorchX states and replicas.
``pytorchjob.py`` and ``trainjob.py`` are the two kinds; this module holds what they share."""

from __future__ import annotations

import abc
import re
import shlex
from typing import Any

from torchx.schedulers.ids import make_unique
from torchx.schedulers.kubernetes_scheduler import (
    LABEL_APP_NAME,
    LABEL_KUBE_APP_NAME,
    LABEL_ORGANIZATION,
    LABEL_ROLE_NAME,
    LABEL_UNIQUE_NAME,
    LABEL_VERSION,
)
from torchx.specs import AppDef, AppState, Role
from torchx.specs.finder import ComponentValidationException
from torchx.util.strings import normalize_str

from schedulers.kubeflow.options import KubeflowOpts

#: Kueue's labels: the LocalQueue a job waits in, and its WorkloadPriorityClass.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
#: TorchX's pod labels that describe the app rather than a role; the job objects carry them too, and
#: ``torchx list`` finds our jobs by the managed-by label.
JOB_LABELS = (LABEL_VERSION, LABEL_APP_NAME, LABEL_KUBE_APP_NAME, LABEL_ORGANIZATION, LABEL_UNIQUE_NAME)

#: Both operators require job names to be RFC 1035 labels (a letter first) and name pods and Services
#: after the job, which must stay within a label's 63 characters too.
MAX_LABEL = 63
_RANDOM_SUFFIX = 8
_LEADING_NON_LETTERS = re.compile(r"^[^a-z]+")


class UnsupportedAppError(ComponentValidationException):
    """The app asks for something the chosen Kubeflow job kind cannot run (raised at dry run)."""


class JobKind(abc.ABC):
    """A Kubeflow job kind, as ``-cfg api=`` names it and app ids (``NAMESPACE:HANDLE_NAME:NAME``) carry it."""

    api: str
    kind: str
    group: str
    version: str
    plural: str
    handle_name: str
    #: The trainer container's name in the pods, which the operator requires.
    container: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def job_object(
        self, name: str, cfg: KubeflowOpts, template_labels: dict[str, str], spec: dict[str, Any]
    ) -> dict[str, Any]:
        """The job object of this kind named ``name``, with ``spec`` (the API's JSON)."""
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": job_metadata(name, cfg, template_labels),
            "spec": spec,
        }

    def unique_name(self, app: AppDef, role: Role) -> str:
        """The app's name made unique, an RFC 1035 label that leaves room for the longest pod name."""
        stem = _LEADING_NON_LETTERS.sub("", normalize_str(app.name)) or "torchx"
        room = MAX_LABEL - len(self.pod_name_suffix(role.num_replicas - 1)) - len("-") - _RANDOM_SUFFIX
        return make_unique(stem[:room].rstrip("-"), _RANDOM_SUFFIX)

    @abc.abstractmethod
    def pod_name_suffix(self, replica_id: int) -> str:
        """What the operator appends to the job's name to name (and give a hostname to) a replica's pod."""

    @abc.abstractmethod
    def manifest(self, app: AppDef, role: Role, name: str, app_id: str, cfg: KubeflowOpts) -> dict[str, Any]:
        """The job object that runs ``role`` of ``app`` (as the API's JSON)."""

    @abc.abstractmethod
    def state(self, job: dict[str, Any]) -> tuple[AppState, str]:
        """The job's TorchX state, and the operator's message that decided it."""

    @abc.abstractmethod
    def pod_selector(self, name: str) -> str:
        """Label selector of the pods the operator created for job ``name``."""

    @abc.abstractmethod
    def replica_id(self, job: dict[str, Any], pod: dict[str, Any]) -> int:
        """TorchX's replica id of the role that ``pod`` runs (0 hosts the rendezvous)."""

    @abc.abstractmethod
    def role(self, job: dict[str, Any]) -> Role:
        """The role the job runs, as far as the object tells (``torchx describe``)."""


def single_role(app: AppDef, kind: JobKind) -> Role:
    if len(app.roles) != 1:
        raise UnsupportedAppError(
            f"app `{app.name}` has {len(app.roles)} roles ({', '.join(r.name for r in app.roles)}); a {kind.kind} "
            "runs one (its replicas are the nodes of one torchrun job): submit each role as an app of its own"
        )
    return app.roles[0]


def job_metadata(name: str, cfg: KubeflowOpts, template_labels: dict[str, str]) -> dict[str, Any]:
    labels = {key: template_labels[key] for key in JOB_LABELS}
    if cfg.queue:
        labels[QUEUE_LABEL] = cfg.queue
    if cfg.workload_priority_class:
        labels[PRIORITY_LABEL] = cfg.workload_priority_class
    return {"name": name, "namespace": cfg.namespace, "labels": labels}


def nproc_per_node(role: Role) -> int | None:
    """torchrun's ``--nproc_per_node`` on the role's command line (TorchX's ``dist.torchrun`` writes
    ``bash -c "torchrun ... --nproc_per_node 8 ..."``); None where the role runs no such command."""
    for arg in role.args:
        try:
            words = shlex.split(arg)
        except ValueError:  # not shell text
            continue
        if "--nproc_per_node" in words[:-1]:
            value = words[words.index("--nproc_per_node") + 1]
            return int(value) if value.isdigit() else None
    return None


def role_from_container(container: dict[str, Any], labels: dict[str, str], num_replicas: int) -> Role:
    command = container.get("command") or [""]
    return Role(
        name=labels.get(LABEL_ROLE_NAME, container.get("name", "")),
        image=container.get("image", ""),
        entrypoint=command[0],
        args=command[1:],
        num_replicas=num_replicas,
    )


def state_from_conditions(
    job: dict[str, Any], condition_states: tuple[tuple[str, AppState], ...]
) -> tuple[AppState, str] | None:
    """The state of the first of ``condition_states`` whose condition is True, with the condition's
    message; None if none is."""
    conditions = job.get("status", {}).get("conditions") or []
    true = {c["type"]: c for c in conditions if c.get("status") == "True"}
    for condition, state in condition_states:
        if condition in true:
            return state, true[condition].get("message", "")
    return None
