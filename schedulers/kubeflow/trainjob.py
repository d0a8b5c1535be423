"""``-cfg api=trainer`` (the default): an app as a TrainJob (trainer.kubeflow.org/v1alpha1) of Kubeflow Trainer 2.2
or later (``runtimePatches``; validated against the models of kubeflow-trainer-api 2.3.0).

A TrainJob names a runtime (``-cfg runtime=``, by default the ClusterTrainingRuntime
``torch-distributed``) whose JobSet runs ``numNodes`` pods of its replicated job ``node``. The TrainJob
sets ``trainer`` (image, command, env, numNodes, numProcPerNode, resourcesPerNode) and, through a
runtime patch of ours, the pods' labels, service account, node selector, image pull secrets and
volumes, and the ``node`` container's mounts; the runtime keeps the rest (restart policy, failure
policy, pod priority).

Rendezvous: the runtime's Torch plugin sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK`` (the pod's completion index) and ``PET_MASTER_ADDR``, pod 0's name under the
JobSet's headless Service, on every pod. TorchX's ``rank0_env`` is ``PET_MASTER_ADDR`` and its
``replica_id`` ``$PET_NODE_RANK``, so torchrun's c10d rendezvous (see ``pytorchjob.py`` for why c10d)
is on pod 0 at the component's port: the plugin's ``PET_MASTER_PORT`` is always 29500, but pods reach
each other's addresses directly, and a headless Service restricts no port.

Not possible in a TrainJob, refused at dry run: an elastic ``-j MIN:MAX`` (the Torch plugin runs a
fixed ``numNodes``), the pods' PriorityClass, and environment variables the plugin reserves. Retries:
the runtime's failure policy decides whether failed pods are replaced; ``--max_retries`` still restarts
trainers in place through torchrun.
"""

from __future__ import annotations

import logging
from typing import Any

from torchx.specs import AppDef, AppState, Role, macros

from schedulers.kubeflow.kinds import (
    JobKind,
    UnsupportedAppError,
    nproc_per_node,
    role_from_container,
    state_from_conditions,
)
from schedulers.kubeflow.options import API_TRAINER, DEFAULT_RUNTIME, KubeflowOpts
from schedulers.kubeflow.pods import pod_template
from schedulers.kubeflow.pytorchjob import is_elastic

#: The runtime's replicated job (and its container) that runs the trainers.
NODE = "node"
#: Who owns our runtime patch (Kueue writes its own, as ``kueue.x-k8s.io/manager``).
PATCH_MANAGER = "torchx.pytorch.org"
#: Variables the Torch plugin sets and the Trainer's webhook refuses in ``trainer.env``.
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: Pod fields a runtime patch may set that ``pod_template`` fills in.
PATCHED_POD_FIELDS = ("serviceAccountName", "nodeSelector", "imagePullSecrets", "volumes")
#: Labels JobSet and the Job controller put on the pods.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"

#: Conditions (when True) that decide the state, first match wins; otherwise the ``node`` job's counts do.
CONDITION_STATES = (("Failed", AppState.FAILED), ("Complete", AppState.SUCCEEDED), ("Suspended", AppState.PENDING))

logger: logging.Logger = logging.getLogger(__name__)


class TrainJobKind(JobKind):
    api = API_TRAINER
    kind = "TrainJob"
    group = "trainer.kubeflow.org"
    version = "v1alpha1"
    plural = "trainjobs"
    handle_name = "trainjob"
    container = NODE

    def pod_name_suffix(self, replica_id: int) -> str:
        return f"-{NODE}-0-{replica_id}"  # JobSet: JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX

    def manifest(self, app: AppDef, role: Role, name: str, app_id: str, cfg: KubeflowOpts) -> dict[str, Any]:
        _check_role(role)
        role = macros.Values(
            img_root="", app_id=app_id, replica_id="$PET_NODE_RANK", rank0_env="PET_MASTER_ADDR"
        ).apply(role)
        template = pod_template(app, role, name, self.container, None, cfg)
        pod = template["spec"]
        (container,) = pod["containers"]
        trainer: dict[str, Any] = {
            "image": container["image"],
            "command": container["command"],
            "env": container["env"],
            "numNodes": role.num_replicas,
        }
        nproc = nproc_per_node(role)
        if nproc is not None:
            trainer["numProcPerNode"] = nproc
        trainer["resourcesPerNode"] = container["resources"]
        container_patch = {"name": NODE, "volumeMounts": container["volumeMounts"]}
        if container.get("securityContext"):  # privileged, for device mounts
            container_patch["securityContext"] = container["securityContext"]
        pod_patch = {key: pod[key] for key in PATCHED_POD_FIELDS if pod.get(key)}
        pod_patch["containers"] = [container_patch]
        pod_template_patch = {"metadata": template["metadata"], "spec": pod_patch}
        runtime_patch = {
            "manager": PATCH_MANAGER,
            "trainingRuntimeSpec": {
                "template": {
                    "spec": {
                        "replicatedJobs": [
                            {"name": NODE, "template": {"spec": {"template": pod_template_patch}}},
                        ]
                    }
                }
            },
        }
        spec: dict[str, Any] = {"runtimeRef": {"name": cfg.runtime or DEFAULT_RUNTIME}}
        if cfg.queue:
            spec["suspend"] = True  # as Kueue's documentation shows; see pytorchjob.py
        spec["trainer"] = trainer
        spec["runtimePatches"] = [runtime_patch]
        return self.job_object(name, cfg, template["metadata"]["labels"], spec)

    def state(self, job: dict[str, Any]) -> tuple[AppState, str]:
        decided = state_from_conditions(job, CONDITION_STATES)
        if decided:
            return decided
        nodes = [s for s in job.get("status", {}).get("jobsStatus") or [] if s["name"] == NODE]
        if not nodes:
            return AppState.SUBMITTED, "Kubeflow Trainer has not created the job's pods yet"
        (node,) = nodes
        # `ready`: the Job's pods are all ready (or done); `active`: some are still pending.
        if node.get("ready") or node.get("succeeded"):
            return AppState.RUNNING, ""
        return AppState.PENDING, "waiting for all the job's pods to start"

    def pod_selector(self, name: str) -> str:
        return f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={NODE}"

    def replica_id(self, job: dict[str, Any], pod: dict[str, Any]) -> int:
        return int(pod["metadata"]["labels"][COMPLETION_INDEX_LABEL])

    def role(self, job: dict[str, Any]) -> Role:
        trainer = job["spec"].get("trainer", {})
        container = {"name": NODE, "image": trainer.get("image", ""), "command": trainer.get("command")}
        return role_from_container(container, _pod_labels(job), trainer.get("numNodes", 1))


def _pod_labels(job: dict[str, Any]) -> dict[str, str]:
    """The labels our runtime patch gives the pods (none on a TrainJob made without TorchX)."""
    for patch in job["spec"].get("runtimePatches", []):
        if patch["manager"] == PATCH_MANAGER:
            (node_job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            return node_job["template"]["spec"]["template"]["metadata"].get("labels", {})
    return {}


def _check_role(role: Role) -> None:
    if is_elastic(role):
        raise UnsupportedAppError(
            f"role `{role.name}` is elastic ({role.min_replicas} to {role.num_replicas} nodes), but a TrainJob "
            f"runs a fixed number of nodes: use -j {role.num_replicas}xNPROC, or api=pytorchjob for an elastic job"
        )
    reserved = sorted(set(role.env) & set(RESERVED_ENV))
    if reserved:
        raise UnsupportedAppError(
            f"--env {', '.join(reserved)}: the TrainJob's Torch runtime sets these itself and refuses them; "
            "leave them out"
        )
    if role.max_retries:
        logger.warning(
            "--max_retries %d restarts trainers in place through torchrun; whether a TrainJob replaces a failed "
            "pod is its runtime's failure policy (runtime=...), not TorchX's",
            role.max_retries,
        )
