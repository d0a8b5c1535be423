"""Run options of ``-s kubeflow`` (``torchx runopts kubeflow``; ``-cfg key=value``), checked before
anything is rendered: every value becomes a Kubernetes name or label value, and the namespace is part
of the app id, which TorchX writes into the trainers' ``bash -c`` command line (``--rdzv_id``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchx.schedulers.api import StructuredOpts
from torchx.specs import InvalidRunConfigException

#: ``api`` values: Kubeflow Trainer's TrainJob (the default), or the Kubeflow training operator's
#: PyTorchJob. TrainJob, as that is where the clusters go: Kueue deprecated its integration of the
#: training operator's (v1) jobs, off by default since mid-2026 and to be removed, and Kubeflow's
#: community distribution no longer ships the training operator v1.
API_PYTORCHJOB = "pytorchjob"
API_TRAINER = "trainer"
DEFAULT_RUNTIME = "torch-distributed"

#: RFC 1123 label (namespaces, and label values such as a queue's name) and subdomain (object names).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_HINT = "lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63"
SUBDOMAIN_HINT = "lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"


@dataclass
class KubeflowOpts(StructuredOpts):
    """Run options of ``-s kubeflow``."""

    api: str = API_TRAINER
    """trainer (a Kubeflow Trainer TrainJob) or pytorchjob (a PyTorchJob of the Kubeflow training operator v1)."""

    namespace: str = "default"
    """Kubernetes namespace the job runs in."""

    queue: str | None = None
    """Kueue LocalQueue (label kueue.x-k8s.io/queue-name); the job waits, suspended, until Kueue admits it."""

    workload_priority_class: str | None = None
    """Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class): queue order, not pod priority."""

    priority_class: str | None = None
    """PriorityClass of the pods (Kueue queues by it too if no workload_priority_class); api=pytorchjob."""

    runtime: str | None = None
    """ClusterTrainingRuntime a TrainJob runs on (api=trainer only); default torch-distributed."""

    service_account: str | None = None
    """Service account of the pods (e.g. one allowed to read the data from object storage)."""

    image_pull_secrets: list[str] | None = None
    """Secrets (kubernetes.io/dockerconfigjson) to pull the image with, separated by ';'."""

    output: str | None = None
    """Also write the job's manifest to this YAML file (kubectl apply -f, GitOps); --dryrun submits nothing."""


def check_opts(cfg: KubeflowOpts) -> None:
    """Refuses, naming the value and the fix, what the API server or Kueue would refuse or ignore."""
    if cfg.api not in (API_PYTORCHJOB, API_TRAINER):
        _refuse(
            cfg,
            "api",
            f"api={cfg.api!r} is not a Kubeflow job API: use api={API_PYTORCHJOB} (PyTorchJob) or "
            f"api={API_TRAINER} (TrainJob)",
        )
    for key in ("namespace", "queue", "workload_priority_class"):
        value = getattr(cfg, key)
        if value is not None and not DNS_LABEL.fullmatch(value):
            _refuse(cfg, key, f"{key}={value!r} is not a Kubernetes name: use {LABEL_HINT} characters")
    for key in ("priority_class", "runtime", "service_account"):
        value = getattr(cfg, key)
        if value is not None and not DNS_SUBDOMAIN.fullmatch(value):
            _refuse(cfg, key, f"{key}={value!r} is not a Kubernetes name: use {SUBDOMAIN_HINT}")
    for secret in cfg.image_pull_secrets or []:
        if not DNS_SUBDOMAIN.fullmatch(secret):
            _refuse(
                cfg,
                "image_pull_secrets",
                f"image_pull_secrets: {secret!r} is not a Secret's name: use "
                f"{SUBDOMAIN_HINT}, several separated by ';'",
            )
    if cfg.workload_priority_class and not cfg.queue:
        _refuse(
            cfg,
            "workload_priority_class",
            f"workload_priority_class={cfg.workload_priority_class} is read by "
            "Kueue only: give the job a queue too (queue=LOCAL_QUEUE), or use priority_class=",
        )
    if cfg.api == API_PYTORCHJOB and cfg.runtime is not None:
        _refuse(
            cfg,
            "runtime",
            f"runtime={cfg.runtime} applies to a TrainJob only: add api={API_TRAINER} or leave runtime out",
        )
    if cfg.api == API_TRAINER and cfg.priority_class is not None:
        _refuse(
            cfg,
            "priority_class",
            f"priority_class={cfg.priority_class}: a TrainJob cannot set its pods' "
            "PriorityClass (its runtime does): use workload_priority_class= with a queue, or api=pytorchjob",
        )


def _refuse(cfg: KubeflowOpts, key: str, reason: str) -> None:
    raise InvalidRunConfigException(reason, key, cfg)
