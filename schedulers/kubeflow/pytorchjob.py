"""``-cfg api=pytorchjob``: an app as a PyTorchJob (kubeflow.org/v1) of the Kubeflow
training operator (v1.7 or later; validated against the models of kubeflow-training 1.9).

Replicas: ``-j NxM`` is a Master (TorchX replica 0) and N-1 Workers, one pod each, with
``nprocPerNode: M``. ``-j MIN:MAXxM`` (elastic) is MAX Workers and no Master, with an ``elasticPolicy``
(minReplicas MIN, maxReplicas MAX, c10d, maxRestarts): the operator's elastic mode, whose rendezvous is
on Worker 0.

Rendezvous: the component starts torchrun with a c10d rendezvous at ``${RANK0_ENV:=localhost}:PORT``
(TorchX's ``rank0_env`` macro names the variable). Every pod gets from the operator ``MASTER_ADDR``,
the Master pod's name (and its headless Service's), and ``MASTER_PORT``, the container port named
``pytorchjob-port``, which is the component's rendezvous port here. So the rendezvous variable is
``MASTER_ADDR``: Workers wait until it resolves (the operator's init container), and on the Master it
is the pod's own hostname, which /etc/hosts resolves before any DNS record exists. c10d rather than the
static rendezvous that the operator's ``PET_NODE_RANK``/``PET_MASTER_ADDR`` describe: torchrun's
restarts (``--max_retries``) and elastic jobs need c10d, and torchrun's explicit arguments
(``--nnodes``, ``--nproc_per_node``) agree with the ``PET_`` variables it would otherwise read. An
elastic job has no Master and so no ``MASTER_ADDR``: ``TORCHX_RANK0_HOST`` names Worker 0, the host
of the operator's ``PET_RDZV_ENDPOINT``. TorchX's ``replica_id`` macro is ``$PET_NODE_RANK`` (0 on
the Master, i+1 on Worker i; shell syntax, as the component's entrypoint is ``bash -c``), on an
elastic Worker its index, read from the pod's label through the downward API.

Retries: ``--max_retries N`` > 0 gives restartPolicy OnFailure and ``runPolicy.backoffLimit: N`` (the
operator counts container restarts against it) besides torchrun's own restarts in place; 0 gives
Never. ``cleanPodPolicy: Running``: when the job ends, pods still running (a Worker hung in a
collective) are deleted and free their GPUs, while finished ones stay for ``torchx log``.

Kueue: ``-cfg queue=`` labels the job and creates it with ``runPolicy.suspend: true``, as Kueue's
documentation shows; Kueue's webhook would set it too, and where Kueue does not manage PyTorchJobs the
job then waits, reported PENDING, instead of running outside the quota.
"""

from __future__ import annotations

import copy
from typing import Any

from torchx.schedulers.kubernetes_scheduler import PLACEHOLDER_FIELD_PATH
from torchx.specs import AppDef, AppState, Role, macros

from schedulers.kubeflow.kinds import (
    JobKind,
    nproc_per_node,
    role_from_container,
    state_from_conditions,
)
from schedulers.kubeflow.options import API_PYTORCHJOB, KubeflowOpts
from schedulers.kubeflow.pods import pod_template

MASTER = "Master"
WORKER = "Worker"
#: The container port the operator reads MASTER_PORT (and an elastic job's rendezvous port) from.
PORT_NAME = "pytorchjob-port"
#: TorchX's dist.torchrun names its rendezvous port so.
TORCHRUN_PORT = "c10d"
#: Labels the operator puts on the pods it creates.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
#: Variables of ours for an elastic job: the rendezvous host (Worker 0) and TorchX's replica id.
ENV_RANK0_HOST = "TORCHX_RANK0_HOST"
ENV_REPLICA_ID = "TORCHX_REPLICA_ID"
#: torchrun's restarts, which the component sets and the operator sets too in an elastic job's pods
#: (from ``elasticPolicy.maxRestarts``, the same --max_retries), appending its own definition.
ENV_MAX_RESTARTS = "PET_MAX_RESTARTS"

#: Conditions (when True) that decide the job's state, first match wins: the operator keeps Created
#: True for good, sets Running False when the job finishes, and Suspended True while Kueue holds it.
CONDITION_STATES = (
    ("Failed", AppState.FAILED),
    ("Succeeded", AppState.SUCCEEDED),
    ("Suspended", AppState.PENDING),
    ("Restarting", AppState.RUNNING),
    ("Running", AppState.RUNNING),
    ("Created", AppState.PENDING),
)


def is_elastic(role: Role) -> bool:
    return role.min_replicas is not None and role.min_replicas < role.num_replicas


class PyTorchJobKind(JobKind):
    api = API_PYTORCHJOB
    kind = "PyTorchJob"
    group = "kubeflow.org"
    version = "v1"
    plural = "pytorchjobs"
    handle_name = "pytorchjob"
    container = "pytorch"

    def pod_name_suffix(self, replica_id: int) -> str:
        return f"-worker-{replica_id}"  # the longest: a Master is "-master-0"

    def manifest(self, app: AppDef, role: Role, name: str, app_id: str, cfg: KubeflowOpts) -> dict[str, Any]:
        elastic = is_elastic(role)
        if elastic:
            role = macros.Values(
                img_root="", app_id=app_id, replica_id=f"${ENV_REPLICA_ID}", rank0_env=ENV_RANK0_HOST
            ).apply(role)
            role.env[ENV_RANK0_HOST] = f"{name}-worker-0"
            role.env.pop(ENV_MAX_RESTARTS, None)  # the operator sets it: ours would be a second definition
            role.env[ENV_REPLICA_ID] = f"{PLACEHOLDER_FIELD_PATH}metadata.labels['{REPLICA_INDEX_LABEL}']"
        else:
            role = macros.Values(
                img_root="", app_id=app_id, replica_id="$PET_NODE_RANK", rank0_env="MASTER_ADDR"
            ).apply(role)
        role.port_map = {(PORT_NAME if port == TORCHRUN_PORT else port): n for port, n in role.port_map.items()}
        restart_policy = "OnFailure" if role.max_retries else "Never"
        template = pod_template(app, role, name, self.container, restart_policy, cfg)

        def replicas(count: int) -> dict[str, Any]:
            # A copy each: YAML would print a shared template once and refer to it (&id001).
            return {"replicas": count, "restartPolicy": restart_policy, "template": copy.deepcopy(template)}

        if elastic:
            replica_specs = {WORKER: replicas(role.num_replicas)}
        else:
            replica_specs = {MASTER: replicas(1)}
            if role.num_replicas > 1:
                replica_specs[WORKER] = replicas(role.num_replicas - 1)
        spec: dict[str, Any] = {"runPolicy": {"backoffLimit": role.max_retries, "cleanPodPolicy": "Running"}}
        if cfg.queue:
            spec["runPolicy"]["suspend"] = True
        nproc = nproc_per_node(role)
        if nproc is not None:
            spec["nprocPerNode"] = str(nproc)
        if elastic:
            spec["elasticPolicy"] = {
                "minReplicas": role.min_replicas,
                "maxReplicas": role.num_replicas,
                "rdzvBackend": "c10d",
                "maxRestarts": role.max_retries,
            }
        spec["pytorchReplicaSpecs"] = replica_specs
        return self.job_object(name, cfg, template["metadata"]["labels"], spec)

    def state(self, job: dict[str, Any]) -> tuple[AppState, str]:
        decided = state_from_conditions(job, CONDITION_STATES)
        return decided or (AppState.SUBMITTED, "the training operator has not picked the job up yet")

    def pod_selector(self, name: str) -> str:
        return f"{JOB_NAME_LABEL}={name}"

    def replica_id(self, job: dict[str, Any], pod: dict[str, Any]) -> int:
        labels = pod["metadata"]["labels"]
        index = int(labels[REPLICA_INDEX_LABEL])
        behind_master = labels[REPLICA_TYPE_LABEL] == WORKER.lower() and MASTER in job["spec"]["pytorchReplicaSpecs"]
        return index + 1 if behind_master else index

    def role(self, job: dict[str, Any]) -> Role:
        replica_specs = job["spec"]["pytorchReplicaSpecs"]
        template = (replica_specs.get(MASTER) or replica_specs[WORKER])["template"]
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == self.container]
        num_replicas = sum(spec.get("replicas", 1) for spec in replica_specs.values())
        return role_from_container(container, template["metadata"].get("labels", {}), num_replicas)
