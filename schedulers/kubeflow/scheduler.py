"""``-s kubeflow`` through the Kubernetes API: submit, status, describe, list, log and cancel.

The cluster and credentials are kubectl's (schedulers/kube_config.py): the pod's service account inside
a cluster, else the kubeconfig (``KUBECONFIG``, ``~/.kube/config``) and its current context. Jobs are custom objects
(CustomObjectsApi); their pods, which the operator creates and labels, give each replica's state,
node and log (CoreV1Api).

App handle: ``kubeflow://SESSION/NAMESPACE:KIND:NAME`` with KIND ``pytorchjob`` or ``trainjob``, the
object's plural less its ``s`` (``kubectl get pytorchjob NAME -n NAMESPACE``). TorchX's kubernetes
scheduler's ``NAMESPACE:NAME`` would leave ``torchx status`` to guess which API to ask. The name is
made unique at dry run, so the handle is known before submission, is what ``-cfg output=`` writes, and
is the ``TORCHX_JOB_ID`` the trainers see.

Cancel deletes the job (foreground: the object stays, reported CANCELLED, until the operator's pods
are gone). Suspending it instead, as TorchX's Volcano scheduler aborts, would not stop it under Kueue,
which owns ``suspend`` and resumes the job once it is admitted again.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Iterable, Iterator, Mapping, cast

import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from torchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    split_lines,
)
from torchx.schedulers.kubernetes_scheduler import LABEL_APP_NAME, LABEL_ORGANIZATION
from torchx.specs import (
    AppDef,
    AppDryRunInfo,
    AppState,
    InvalidRunConfigException,
    ReplicaStatus,
    RoleStatus,
    runopts,
)
from urllib3 import HTTPResponse
from urllib3.exceptions import HTTPError

from schedulers.combined_logs import CombinedLogs, LogRequest
from schedulers.kube_config import api_client
from schedulers.kubeflow.kinds import JobKind, single_role
from schedulers.kubeflow.options import KubeflowOpts, check_opts
from schedulers.kubeflow.pytorchjob import PyTorchJobKind
from schedulers.kubeflow.trainjob import TrainJobKind
from schedulers.node_request import NodeRequestCheck
from schedulers.setup_checks import SetupError

KINDS: tuple[JobKind, ...] = (PyTorchJobKind(), TrainJobKind())
#: What ``pod_labels`` marks our objects with; ``torchx list`` lists only those.
MANAGED_BY = f"{LABEL_ORGANIZATION}=torchx.pytorch.org"

#: Pod phase -> the state of the replica the pod runs.
POD_PHASE_STATES = {
    "Pending": AppState.PENDING,
    "Running": AppState.RUNNING,
    "Succeeded": AppState.SUCCEEDED,
    "Failed": AppState.FAILED,
    "Unknown": AppState.UNKNOWN,
}

logger: logging.Logger = logging.getLogger(__name__)


class KubeflowApiError(SetupError):
    """The Kubernetes API refused a request, or could not be reached; the message says which and why.
    A SetupError: ``torchx run`` prints it as its one line, not as a traceback.

    ``missing``: what a 404 said does not exist, ``object`` (the job) or ``api`` (its kind: the
    operator is not installed); None for other errors.
    """

    def __init__(self, message: str, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class JobRef:
    """Which job an app id names: ``NAMESPACE:KIND:NAME``."""

    namespace: str
    kind: JobKind
    name: str

    @property
    def app_id(self) -> str:
        return f"{self.namespace}:{self.kind.handle_name}:{self.name}"

    @classmethod
    def parse(cls, app_id: str) -> JobRef:
        parts = app_id.split(":")
        kinds = {kind.handle_name: kind for kind in KINDS}
        if len(parts) != 3 or not all(parts) or parts[1] not in kinds:
            raise ValueError(
                f"`{app_id}` is not a kubeflow app id: expected NAMESPACE:KIND:NAME with KIND one of "
                f"{', '.join(kinds)} (e.g. default:pytorchjob:dlrm-bx3k9w2q)"
            )
        namespace, kind_name, name = parts
        return cls(namespace, kinds[kind_name], name)

    def __str__(self) -> str:
        return f"{self.kind.kind} {self.namespace}/{self.name}"


@dataclass
class KubeflowJob:
    """The request of a dry run: the job object to create, printed as the YAML ``kubectl apply`` takes."""

    resource: dict[str, Any]
    kind: JobKind

    @property
    def ref(self) -> JobRef:
        metadata = self.resource["metadata"]
        return JobRef(metadata["namespace"], self.kind, metadata["name"])

    def __str__(self) -> str:
        # One line per value however long (the trainers' command line), keys in the API's order.
        return yaml.safe_dump(self.resource, sort_keys=False, width=2**31)


class KubeflowScheduler(NodeRequestCheck, CombinedLogs, Scheduler[KubeflowOpts]):
    """Runs TorchX apps as Kubeflow PyTorchJobs or TrainJobs (``-cfg api=``), optionally queued by Kueue.

    Mounts: ``type=bind,src=HOST_PATH,dst=PATH[,readonly]`` (hostPath),
    ``type=volume,src=CLAIM,dst=PATH[,readonly]`` (PersistentVolumeClaim),
    ``type=volume,src=configmap:NAME,dst=PATH`` and ``src=secret:NAME`` (a ConfigMap's or Secret's
    keys as files), ``type=device,src=/dev/X`` (privileged; prefer a device plugin's resource).
    Images: ``--image`` as it is; workspaces are not built (push the image first).
    Logs: ``torchx log`` reads the trainer container of each replica's newest pod.
    """

    def __init__(self, session_name: str) -> None:
        super().__init__("kubeflow", session_name)

    def _run_opts(self) -> runopts:
        return KubeflowOpts.as_runopts()

    # ── submission ───────────────────────────────────────────────────────────────────────

    def _submit_dryrun(self, app: AppDef, cfg: KubeflowOpts) -> AppDryRunInfo[KubeflowJob, KubeflowOpts]:
        check_opts(cfg)
        (kind,) = [kind for kind in KINDS if kind.api == cfg.api]
        role = single_role(app, kind)
        ref = JobRef(cfg.namespace, kind, kind.unique_name(app, role))
        job = KubeflowJob(kind.manifest(app, role, ref.name, ref.app_id, cfg), kind)
        if cfg.output:
            _write_manifest(cfg, str(job))
        return AppDryRunInfo(job, str)

    def schedule(self, dryrun_info: AppDryRunInfo[KubeflowJob, KubeflowOpts]) -> str:
        job = dryrun_info.request
        ref = job.ref
        with _api_errors(f"creating {ref}", ref.kind):
            self._objects.create_namespaced_custom_object(
                ref.kind.group, ref.kind.version, ref.namespace, ref.kind.plural, job.resource
            )
        return ref.app_id

    # ── status ───────────────────────────────────────────────────────────────────────────

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        ref = JobRef.parse(app_id)
        job = self._get(ref)
        if job is None:
            return None
        state, msg = _job_state(ref.kind, job)
        role = ref.kind.role(job)
        pods = self._replica_pods(ref, job)
        replicas = []
        for replica_id in range(role.num_replicas):
            pod = pods.get(replica_id, [{}])[-1]
            phase = pod.get("status", {}).get("phase")
            replicas.append(
                ReplicaStatus(
                    id=replica_id,
                    role=role.name,
                    state=POD_PHASE_STATES.get(phase, state),
                    hostname=pod.get("spec", {}).get("nodeName", ""),
                )
            )
        return DescribeAppResponse(
            app_id=app_id,
            state=state,
            msg=msg,
            num_restarts=max((_restarts(tries, ref.kind.container) for tries in pods.values()), default=0),
            roles=[role],
            roles_statuses=[RoleStatus(role.name, replicas)],
        )

    def list(self, cfg: Mapping[str, Any] | None = None) -> list[ListAppResponse]:
        """TorchX's PyTorchJobs and TrainJobs in ``cfg["namespace"]`` (default: ``default``); a kind whose
        operator is not installed has none."""
        namespace = str((cfg or {}).get("namespace") or KubeflowOpts.namespace)
        apps = []
        for kind in KINDS:
            for job in self._list(kind, namespace):
                metadata = job["metadata"]
                apps.append(
                    ListAppResponse(
                        app_id=JobRef(namespace, kind, metadata["name"]).app_id,
                        state=_job_state(kind, job)[0],
                        name=metadata.get("labels", {}).get(LABEL_APP_NAME, metadata["name"]),
                    )
                )
        return apps

    def _cancel_existing(self, app_id: str) -> None:
        ref = JobRef.parse(app_id)
        with _api_errors(f"deleting {ref}", ref.kind):
            self._objects.delete_namespaced_custom_object(
                ref.kind.group,
                ref.kind.version,
                ref.namespace,
                ref.kind.plural,
                ref.name,
                propagation_policy="Foreground",
            )

    # ── logs ─────────────────────────────────────────────────────────────────────────────

    ONE_STREAM = "a pod's log has stdout and stderr together"

    def _replica_log(self, asked: LogRequest) -> Iterator[str]:
        ref = JobRef.parse(asked.app_id)
        query: dict[str, Any] = {
            "name": self._replica_pod(ref, asked),
            "namespace": ref.namespace,
            "container": ref.kind.container,
        }
        if asked.since is not None:
            query["since_seconds"] = max(int((datetime.now(timezone.utc) - _aware(asked.since)).total_seconds()), 1)
        if asked.until is not None:
            query["timestamps"] = True  # to stop at `until`; taken off each line again
        lines = self._log_lines(query, asked.should_tail)
        return _until(lines, _aware(asked.until)) if asked.until is not None else lines

    def _replica_pod(self, ref: JobRef, asked: LogRequest) -> str:
        """The name of the newest pod of the replica ``asked`` for; raises ValueError naming what is not there."""
        job = self._get(ref)
        if job is None:
            raise ValueError(f"no {ref} for app `{asked.app_id}`")
        role = ref.kind.role(job)
        if asked.role_name != role.name or not 0 <= asked.k < role.num_replicas:
            raise ValueError(
                f"{ref} runs role `{role.name}` with replicas 0 to {role.num_replicas - 1}, "
                f"not `{asked.role_name}` {asked.k}: use {role.name}/0"
            )
        tries = self._replica_pods(ref, job).get(asked.k)
        if not tries:
            raise ValueError(
                f"replica {asked.k} of {ref} has no pod yet (the job is {_job_state(ref.kind, job)[0]}): "
                "try again once it runs"
            )
        return tries[-1]["metadata"]["name"]

    def _log_lines(self, query: dict[str, Any], should_tail: bool) -> Iterator[str]:
        with _api_errors(f"reading the log of pod {query['namespace']}/{query['name']}"):
            if should_tail:
                for line in watch.Watch().stream(self._core.read_namespaced_pod_log, **query):
                    yield line + "\n"
            else:
                yield from split_lines(self._core.read_namespaced_pod_log(**query))

    # ── the API ──────────────────────────────────────────────────────────────────────────

    @cached_property
    def _api(self) -> client.ApiClient:
        return api_client(self.backend, "; a dry run (--dryrun) needs no cluster")

    @cached_property
    def _objects(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self._api)

    @cached_property
    def _core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self._api)

    def _get(self, ref: JobRef) -> dict[str, Any] | None:
        try:
            with _api_errors(f"reading {ref}", ref.kind):
                # The client types a custom object as object; it is the JSON object the API returned.
                return cast(
                    dict[str, Any],
                    self._objects.get_namespaced_custom_object(
                        ref.kind.group, ref.kind.version, ref.namespace, ref.kind.plural, ref.name
                    ),
                )
        except KubeflowApiError as e:
            if e.missing == "object":
                return None
            raise

    # In the class, list is the method: builtins.list is the type.
    def _list(self, kind: JobKind, namespace: str) -> builtins.list[dict[str, Any]]:
        try:
            with _api_errors(f"listing {kind.kind}s in namespace {namespace}", kind):
                listed = cast(
                    dict[str, Any],
                    self._objects.list_namespaced_custom_object(  # as in _get
                        kind.group, kind.version, namespace, kind.plural, label_selector=MANAGED_BY
                    ),
                )
                return listed["items"]
        except KubeflowApiError as e:
            if e.missing == "api":  # a cluster runs one operator or the other
                return []
            raise

    def _replica_pods(self, ref: JobRef, job: dict[str, Any]) -> dict[int, builtins.list[dict[str, Any]]]:
        """The job's pods by TorchX replica id, oldest first (a replaced pod leaves its successor last)."""
        with _api_errors(f"listing the pods of {ref}"):
            # With _preload_content=False the client returns urllib3's response, not the V1PodList it is typed as.
            pods = cast(
                HTTPResponse,
                self._core.list_namespaced_pod(
                    ref.namespace, label_selector=ref.kind.pod_selector(ref.name), _preload_content=False
                ),
            )
        by_replica: dict[int, list[dict[str, Any]]] = {}
        items = json.loads(pods.data)["items"]
        for pod in sorted(items, key=lambda pod: pod["metadata"].get("creationTimestamp", "")):
            by_replica.setdefault(ref.kind.replica_id(job, pod), []).append(pod)
        return by_replica


@contextlib.contextmanager
def _api_errors(doing: str, kind: JobKind | None = None) -> Iterator[None]:
    """Turns the client's errors into one-line KubeflowApiErrors, saying what ``doing`` failed and why."""
    try:
        yield
    except ApiException as e:
        body = _status_body(e)
        # The API server names the object it did not find; a resource it does not serve, it does not.
        missing = ("object" if body.get("details", {}).get("name") else "api") if e.status == 404 else None
        hint = ""
        if missing == "api" and kind is not None:
            hint = f": is the {kind.kind} API installed? (kubectl get crd {kind.plural}.{kind.group})"
        message = body.get("message") or e.reason
        raise KubeflowApiError(
            f"{doing}: the Kubernetes API answered {e.status} {e.reason}: {message}{hint}", missing
        ) from None
    except HTTPError as e:
        raise KubeflowApiError(
            f"{doing}: the Kubernetes API server cannot be reached ({type(e).__name__}): check "
            "`kubectl config current-context` and KUBECONFIG"
        ) from None


def _status_body(e: ApiException) -> dict[str, Any]:
    """The Status object the API server answered with, if the body is one."""
    try:
        body = json.loads(e.body or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _job_state(kind: JobKind, job: dict[str, Any]) -> tuple[AppState, str]:
    if job["metadata"].get("deletionTimestamp"):
        return AppState.CANCELLED, f"being deleted since {job['metadata']['deletionTimestamp']}"
    return kind.state(job)


def _restarts(tries: list[dict[str, Any]], container: str) -> int:
    """How often a replica was restarted: pods replaced, and the trainer container's restarts in the newest."""
    statuses = tries[-1].get("status", {}).get("containerStatuses") or []
    in_place = sum(s.get("restartCount", 0) for s in statuses if s.get("name") == container)
    return len(tries) - 1 + in_place


def _until(lines: Iterable[str], until: datetime) -> Iterator[str]:
    """``lines`` (each led by the API's RFC 3339 timestamp) written before ``until``, without the timestamp."""
    for line in lines:
        stamp, _, text = line.partition(" ")
        if _parse_timestamp(stamp) > until:
            return
        yield text


def _parse_timestamp(stamp: str) -> datetime:
    # The API writes nanoseconds (2026-11-23T10:00:01.123456789Z); datetime takes microseconds.
    seconds, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{seconds}.{(fraction + '000000')[:6]}+00:00")


def _aware(moment: datetime) -> datetime:
    """TorchX hands over naive local times; the API's are UTC."""
    return moment.astimezone(timezone.utc)


def _write_manifest(cfg: KubeflowOpts, text: str) -> None:
    try:
        with open(str(cfg.output), "w") as f:
            f.write(text)
    except OSError as e:
        raise InvalidRunConfigException(
            f"output={cfg.output!r} cannot be written ({e.strerror}): give a file in a folder that exists and "
            "you may write to",
            "output",
            cfg,
        ) from None
    logger.info("wrote the job's manifest to %s (kubectl apply -f %s)", cfg.output, cfg.output)


def create_scheduler(session_name: str, **kwargs: Any) -> KubeflowScheduler:
    return KubeflowScheduler(session_name)
