"""``-s kubernetes``: TorchX's Volcano scheduler, whose dry run needs neither Docker nor a cluster.

Registered in ``torchx_plugins/schedulers/dlrm_kubernetes.py`` under TorchX's own name (a registered
scheduler replaces the built-in one), because TorchX's dry run needs both:

- the workspace (by default the folder ``torchx run`` runs in) is built into an image with Docker; without
  an engine that was a traceback. Here the dry run leaves the build out and says so, and a submission is
  refused in one line (schedulers/docker_builds.py);
- ``validate_spec`` (on by default) has the API server check the job; without a kubeconfig TorchX warned and
  then failed with a traceback from connecting to localhost. Here a dry run without a cluster skips the
  check and says so, and a submission is refused in one line naming where kubectl's kubeconfig was
  looked for (schedulers/kube_config.py);
- TorchX writes the app's name into the job's and pods' labels as it is, and names the pods after it
  without a bound: a name ending in '.', '-' or '_' (``--name run.``) made label values the API server
  refuses, and a long one pod names beyond Kubernetes' 63 characters. Here the app is rendered under
  its name as a label value (schedulers/kube_labels.py), cut so that its pods' names fit
  (:func:`volcano_app_name`); the job's environment keeps the name as given;
- with ``--max_retries``, TorchX's tasks restart the whole job on any failed pod, a refusal too
  (the launcher exits 2: a bad option or data fails again on every attempt). Here the tasks' first
  policy ends the job on exit code 2 (Volcano applies a task's first matching policy).

Everything else is TorchX's: the Volcano job, submission, status, logs, cancel, run options.
"""

import dataclasses
import logging
from typing import Any

from kubernetes.client import ApiClient
from torchx.schedulers import kubernetes_scheduler
from torchx.schedulers.kubernetes_scheduler import KubernetesJob, KubernetesOpts, normalize_str
from torchx.specs import AppDef, AppDryRunInfo

from apps.core.common.errors import REFUSED
from schedulers.docker_builds import DryRunWithoutDockerMixin
from schedulers.kube_config import api_client
from schedulers.kube_labels import label_value
from schedulers.node_request import NodeRequestCheck
from schedulers.setup_checks import SetupError

logger: logging.Logger = logging.getLogger(__name__)

#: What TorchX appends to an app's name for its job's: '-' and a random id of at most 14 characters.
UNIQUE_SUFFIX = 15
#: Kubernetes' longest pod name (a label: the pod's hostname).
POD_NAME = 63
#: Ahead of TorchX's retry policies: a pod that exited as a refusal ends the job, unretried.
REFUSAL_POLICY = {"exitCode": REFUSED, "action": "TerminateJob"}


def volcano_app_name(app: AppDef) -> str:
    """``app``'s name as TorchX's Volcano job can carry it: a label value, cut so that the job's
    longest pod name (``{name}-{unique id}-{role}-{replica}-0``, TorchX's) fits Kubernetes' 63."""
    pod_suffix = max(len(f"-{normalize_str(f'{role.name}-{role.num_replicas - 1}')}-0") for role in app.roles)
    return label_value(app.name[: POD_NAME - UNIQUE_SUFFIX - pod_suffix])


class KubernetesScheduler(NodeRequestCheck, DryRunWithoutDockerMixin, kubernetes_scheduler.KubernetesScheduler):
    """TorchX's KubernetesScheduler, with dry runs that need no Docker and no cluster."""

    _client: ApiClient | None  # TorchX's: the client given to the constructor, else the one made on first use

    def _api_client(self) -> ApiClient:
        if self._client is None:
            self._client = api_client(self.backend, "; a dry run (--dryrun) needs no cluster")
        return self._client

    def _submit_dryrun(self, app: AppDef, cfg: KubernetesOpts) -> AppDryRunInfo[KubernetesJob, KubernetesOpts]:
        if cfg.validate_spec:
            try:
                self._api_client()
            except SetupError as e:
                logger.warning("the API server does not check this request (validate_spec): %s", e)
                cfg = dataclasses.replace(cfg, validate_spec=False)
        info = super()._submit_dryrun(dataclasses.replace(app, name=volcano_app_name(app)), cfg)
        for task in info.request.resource["spec"]["tasks"]:
            if task.get("policies"):  # TorchX's retries (--max_retries)
                task["policies"] = [REFUSAL_POLICY, *task["policies"]]
        return info

    def schedule(self, dryrun_info: AppDryRunInfo[KubernetesJob, KubernetesOpts]) -> str:
        self.refuse_unbuilt_workspaces(dryrun_info.app)
        self._api_client()  # before an image is pushed
        return super().schedule(dryrun_info)


def create_scheduler(session_name: str, **kwargs: Any) -> KubernetesScheduler:
    return KubernetesScheduler(
        session_name=session_name, client=kwargs.get("client"), docker_client=kwargs.get("docker_client")
    )
