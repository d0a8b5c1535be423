"""``-s kubeflow`` (schedulers/kubeflow/): the PyTorchJobs and TrainJobs it generates, and TorchX's verbs
on them.

Generated objects are checked offline against the operators' published models, strictly
(tests/kubeflow_validation.py; the 2-node p4d goldens are in tests/integration/test_dryrun.py). The verbs run as a
user runs them, ``torchx run/status/describe/list/log/cancel`` (or TorchX's runner, where many cases
need no second process), against a Kubernetes API on loopback (tests/kubeflow_server.py) that replays
what the operators write at each stage (tests/kubeflow_responses/): no kube-apiserver can be had here.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
from datetime import datetime, timezone

import pytest
import yaml
from torchx import specs
from torchx.runner import get_runner
from torchx.specs.finder import ComponentValidationException

from schedulers.kubeflow.scheduler import KubeflowApiError
from schedulers.setup_checks import SetupError
from tests.conftest import BIN, run
from tests.kubeflow_server import RESPONSES, TOKEN, FakeCluster, fake_cluster
from tests.kubeflow_validation import validate_pytorchjob, validate_recorded, validate_trainjob

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

TRAIN_2X8 = ["-j", "2x8", "-h", "aws_p4d.24xlarge", "--batch_size", "8192"]
QUEUED = {"queue": "dlrm", "service_account": "dlrm-trainer", "image_pull_secrets": ["regcred"]}
#: -s kubeflow makes a TrainJob unless told otherwise.
PYTORCHJOB = {"api": "pytorchjob"}
S = specs.AppState


def torchx(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run([os.path.join(BIN, "torchx"), *args], timeout=120, **env)


def manifest(cfg: dict, *component_args: str) -> dict:
    """The job object ``torchx run --dryrun -s kubeflow`` renders, through TorchX's runner."""
    info = get_runner().dryrun_component("components.dlrm:train", list(component_args), "kubeflow", cfg=cfg)
    return info.request.resource


def containers(job: dict) -> list[dict]:
    """The trainer containers of a PyTorchJob's replica types, or a TrainJob's trainer."""
    if job["kind"] == "TrainJob":
        return [job["spec"]["trainer"]]
    return [spec["template"]["spec"]["containers"][0] for spec in job["spec"]["pytorchReplicaSpecs"].values()]


def command(container: dict) -> str:
    (line,) = container["command"][2:]
    return line


def env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def runtime_pod(job: dict) -> dict:
    """The pod template patch of a TrainJob's ``node`` job."""
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    return node["template"]["spec"]["template"]


# ── the objects ─────────────────────────────────────────────────────────────────────────────


@pytest.mark.unit
def test_pytorchjob_of_a_2_node_p4d_job_is_a_master_and_a_worker_meeting_at_master_addr():
    job = manifest({**PYTORCHJOB, **QUEUED, "workload_priority_class": "research"}, *TRAIN_2X8)
    assert validate_pytorchjob(job) == []
    name = job["metadata"]["name"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "dlrm"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research"
    assert job["spec"]["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "Running", "suspend": True}
    assert job["spec"]["nprocPerNode"] == "8"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {t: (s["replicas"], s["restartPolicy"]) for t, s in replicas.items()} == {
        "Master": (1, "Never"),
        "Worker": (1, "Never"),
    }
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        # The operator's MASTER_ADDR is the rendezvous host, MASTER_PORT the port named pytorchjob-port.
        assert container["ports"] == [{"containerPort": 29500, "name": "pytorchjob-port"}]
        assert "--rdzv_endpoint ${MASTER_ADDR:=localhost}:29500 " in command(container)
        assert "--nnodes 2 --nproc_per_node 8" in command(container)
        assert env(container)["TORCHX_JOB_ID"] == f"kubeflow://torchx/default:pytorchjob:{name}"
        assert container["resources"]["limits"].items() >= {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}.items()
        assert {"mountPath": "/dev/shm", "name": "dshm"} in container["volumeMounts"]
        assert {"emptyDir": {"medium": "Memory"}, "name": "dshm"} in pod["volumes"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
        assert (pod["serviceAccountName"], pod["imagePullSecrets"]) == ("dlrm-trainer", [{"name": "regcred"}])


@pytest.mark.unit
def test_trainjob_of_a_2_node_p4d_job_runs_on_the_torch_runtime_meeting_at_pet_master_addr():
    job = manifest({**QUEUED, "api": "trainer"}, *TRAIN_2X8)
    assert validate_trainjob(job) == []
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert job["spec"]["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "dlrm"
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert "--rdzv_endpoint ${PET_MASTER_ADDR:=localhost}:29500 " in command(trainer)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainer["resourcesPerNode"]["limits"]["vpc.amazonaws.com/efa"] == "4"
    pod = runtime_pod(job)
    assert pod["metadata"]["labels"]["torchx.pytorch.org/role-name"] == "train"
    assert pod["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert pod["spec"]["serviceAccountName"] == "dlrm-trainer"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"emptyDir": {"medium": "Memory"}, "name": "dshm"} in pod["spec"]["volumes"]
    assert pod["spec"]["containers"] == [{"name": "node", "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}]}]


@pytest.mark.unit
def test_the_default_kind_is_a_trainjob():
    # Kueue deprecated its integration of the training operator's (v1) PyTorchJobs, and Kubeflow's
    # distribution no longer ships that operator: Kubeflow Trainer's TrainJob is where clusters go.
    job = manifest({}, "-j", "2x1")
    assert job["kind"] == "TrainJob" and validate_trainjob(job) == []


@pytest.mark.unit
def test_retries_become_the_restart_policy_and_backoff_limit_the_operator_applies():
    job = manifest(PYTORCHJOB, "-j", "3x2", "--max_retries", "2")
    assert validate_pytorchjob(job) == []
    assert job["spec"]["runPolicy"]["backoffLimit"] == 2
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert [(t, s["replicas"], s["restartPolicy"]) for t, s in replicas.items()] == [
        ("Master", 1, "OnFailure"),
        ("Worker", 2, "OnFailure"),
    ]
    for container in containers(job):  # and torchrun restarts the trainers in place as often
        assert env(container)["PET_MAX_RESTARTS"] == "2"
    assert "suspend" not in job["spec"]["runPolicy"]  # no queue: nothing to wait for


@pytest.mark.unit
def test_elastic_job_is_workers_only_with_the_operators_elastic_policy():
    job = manifest(PYTORCHJOB, "-j", "1:4x2", "--max_retries", "3")
    assert validate_pytorchjob(job) == []
    name = job["metadata"]["name"]
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d", "maxRestarts": 3}
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    (container,) = containers(job)
    # No Master, so no MASTER_ADDR: Worker 0 hosts the rendezvous, as the operator's PET_RDZV_ENDPOINT says.
    assert "--rdzv_endpoint ${TORCHX_RANK0_HOST:=localhost}:29500 " in command(container)
    assert "--nnodes 1:4" in command(container)
    variables = env(container)
    assert variables["TORCHX_RANK0_HOST"] == f"{name}-worker-0"
    assert variables["TORCHX_REPLICA_ID"] == {
        "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}
    }
    # The operator appends PET_MAX_RESTARTS (maxRestarts) to each pod's variables: ours would be a second one.
    assert "PET_MAX_RESTARTS" not in variables


@pytest.mark.unit
def test_single_node_job_is_a_master_alone():
    job = manifest(PYTORCHJOB, "-j", "1x2")
    assert validate_pytorchjob(job) == []
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]


@pytest.mark.unit
@pytest.mark.parametrize("api", ["pytorchjob", "trainer"])
def test_mounts_become_volumes_of_each_kind(api):
    mounts = (
        "type=bind,src=/fsx,dst=/fsx,type=volume,src=criteo,dst=/data,readonly,"
        "type=volume,src=configmap:dlrm-presets,dst=/etc/dlrm,"
        "type=volume,src=secret:s3-keys,dst=/etc/s3,readonly,type=device,src=/dev/fuse"
    )
    job = manifest({"api": api}, "-j", "2x1", "--mounts", mounts)
    assert (validate_pytorchjob if api == "pytorchjob" else validate_trainjob)(job) == []
    if api == "pytorchjob":
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        container = pod["containers"][0]
    else:
        pod = runtime_pod(job)["spec"]
        (container,) = pod["containers"]
    volumes = {v["name"]: {k: v for k, v in v.items() if k != "name"} for v in pod["volumes"]}
    mounted = {m["mountPath"]: (volumes[m["name"]], m.get("readOnly")) for m in container["volumeMounts"]}
    assert mounted == {
        "/dev/shm": ({"emptyDir": {"medium": "Memory"}}, None),
        "/fsx": ({"hostPath": {"path": "/fsx"}}, False),
        "/data": ({"persistentVolumeClaim": {"claimName": "criteo"}}, True),
        "/dev/fuse": ({"hostPath": {"path": "/dev/fuse"}}, False),
        "/etc/dlrm": ({"configMap": {"name": "dlrm-presets"}}, False),
        "/etc/s3": ({"secret": {"secretName": "s3-keys"}}, True),
    }
    assert container["securityContext"] == {"privileged": True}  # Kubernetes has no --device


@pytest.mark.unit
@pytest.mark.parametrize("api, infix", [("pytorchjob", "-worker-"), ("trainer", "-node-0-")])
def test_job_names_are_rfc1035_labels_that_leave_room_for_the_pods_hostnames(api, infix):
    job = manifest({"api": api}, "-j", "16x1", "--name", "2026.Criteo_1TB-" + "x" * 80)
    name = job["metadata"]["name"]
    assert re.fullmatch(r"criteo1tb-x+-[a-z0-9]{8}", name), name  # a letter first: RFC 1035
    assert len(f"{name}{infix}15") == 63
    assert (validate_pytorchjob if api == "pytorchjob" else validate_trainjob)(job) == []


@pytest.mark.unit
@pytest.mark.parametrize("api", ["pytorchjob", "trainer"])
@pytest.mark.parametrize("name", ["run_", "ctr/run-", "a.b.", "x" * 62 + "_y"])
def test_job_names_ending_in_what_a_label_value_cannot_end_in_become_label_values(api, name):
    # TorchX writes the job's name into labels, ending them in '.' where the name ends in '-', '_' or '.'.
    job = manifest({"api": api}, "-j", "2x1", "--name", name)
    assert (validate_pytorchjob if api == "pytorchjob" else validate_trainjob)(job) == []
    app_name = job["metadata"]["labels"]["torchx.pytorch.org/app-name"]
    assert app_name == name.rpartition("/")[2][:63].strip("-_."), app_name


def test_output_writes_the_manifest_kubectl_applies_and_the_dry_run_submits_nothing(tmp_path):
    path = tmp_path / "dlrm-job.yaml"
    result = torchx(
        "run",
        "--dryrun",
        "-s",
        "kubeflow",
        "-cfg",
        f"queue=dlrm,output={path}",
        "components.dlrm:train",
        *TRAIN_2X8,
        KUBECONFIG=str(tmp_path / "no-cluster"),
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.split("=== SCHEDULER REQUEST ===\n", 1)[1]
    assert path.read_text().strip() == printed.strip()
    assert validate_trainjob(yaml.safe_load(path.read_text())) == []  # the default kind


@pytest.mark.unit
@pytest.mark.parametrize(
    "cfg, component_args, fragment",
    [
        ({"api": "volcano"}, [], "api='volcano' is not a Kubeflow job API: use api=pytorchjob (PyTorchJob) or"),
        ({"namespace": "ML_Team"}, [], "namespace='ML_Team' is not a Kubernetes name: use lowercase letters"),
        ({"queue": "a/b"}, [], "queue='a/b' is not a Kubernetes name"),
        ({"image_pull_secrets": ["reg cred"]}, [], "image_pull_secrets: 'reg cred' is not a Secret's name"),
        ({"workload_priority_class": "high"}, [], "workload_priority_class=high is read by Kueue only: give"),
        (
            {**PYTORCHJOB, "runtime": "torch-distributed"},
            [],
            "runtime=torch-distributed applies to a TrainJob only: add api=trainer",
        ),
        ({"priority_class": "high"}, [], "a TrainJob cannot set its pods' PriorityClass"),
        ({"output": "/nonexistent/job.yaml"}, [], "output='/nonexistent/job.yaml' cannot be written (No such file"),
        ({"api": "trainer"}, ["-j", "1:4x2"], "a TrainJob runs a fixed number of nodes: use -j 4xNPROC, or api="),
        ({"api": "trainer"}, ["--env", "PET_NNODES=3"], "--env PET_NNODES: the TrainJob's Torch runtime sets these"),
        (
            {},
            ["--mounts", "type=volume,src=configmap:Bad_Name,dst=/etc/dlrm"],
            "--mounts src='configmap:Bad_Name': 'Bad_Name' is not a ConfigMap's name: use lowercase letters, digits",
        ),
        (
            PYTORCHJOB,
            ["--mounts", "type=volume,src=secret:../../x,dst=/etc/s3"],
            "--mounts src='secret:../../x': '../../x' is not a Secret's name: use lowercase letters",
        ),
        ({}, ["--mounts", "type=volume,src=configmap:,dst=/etc/dlrm"], "'' is not a ConfigMap's name"),
        ({}, ["--mounts", "type=volume,src=Criteo,dst=/data"], "'Criteo' is not a PersistentVolumeClaim's name"),
        ({}, ["--mounts", "type=bind,src=data,dst=/data"], "--mounts src='data' is not a host path the API takes"),
        (
            {},
            ["--mounts", "type=bind,src=/fsx,dst=/data,type=volume,src=criteo,dst=/data/"],
            "--mounts dst=/data/ is mounted twice (src=/fsx and src=criteo): give each mount a dst of its own",
        ),
        (
            PYTORCHJOB,
            ["--mounts", "type=bind,src=/fsx,dst=/dev/shm"],
            "--mounts dst=/dev/shm is mounted twice (the pod's memory-backed /dev/shm and src=/fsx)",
        ),
        ({}, ["--mounts", "type=bind,src=/fsx,dst=fsx"], "--mounts dst='fsx' is not an absolute path in the container"),
        (
            {},
            ["--image", "torchrec dlrm:latest"],
            "--image 'torchrec dlrm:latest' is not a container image reference: use [REGISTRY/]REPOSITORY[:TAG]",
        ),
        (
            PYTORCHJOB,
            ["--image", "torchrec-dlrm:latest\n"],
            "--image 'torchrec-dlrm:latest\\n' is not a container image",
        ),
    ],
)
def test_what_a_cluster_would_refuse_is_refused_naming_the_value_and_the_fix(cfg, component_args, fragment):
    with pytest.raises((specs.InvalidRunConfigException, ComponentValidationException)) as refused:
        manifest(cfg, *component_args)
    assert fragment in str(refused.value)


def test_a_refused_mount_is_one_line_on_the_command_line_not_a_traceback():
    mounts = "type=volume,src=configmap:Bad_Name,dst=/etc/dlrm"
    result = torchx("run", "--dryrun", "-s", "kubeflow", "components.dlrm:train", "--mounts", mounts)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.rstrip().endswith(
        "--mounts src='configmap:Bad_Name': 'Bad_Name' is not a ConfigMap's name: use lowercase letters, digits, "
        "'-' and '.', starting and ending with a letter or digit"
    ), result.stderr


def test_a_refused_option_is_one_line_on_the_command_line_not_a_traceback():
    result = torchx("run", "--dryrun", "-s", "kubeflow", "-cfg", "api=volcano", "components.dlrm:train")
    assert result.returncode == 1
    assert "Invalid scheduler configuration: api='volcano' is not a Kubeflow job API" in result.stderr
    assert "Traceback" not in result.stderr


def _spec(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


@pytest.mark.parametrize(
    "api, break_it, fragment",
    [
        (
            "pytorchjob",
            lambda job: _spec(job).update(nodeSelecter={"a": "b"}),
            "spec.nodeSelecter: V1PodSpec has no such field",
        ),
        (
            "pytorchjob",
            lambda job: job["spec"]["runPolicy"].update(cleanPodPolicies="All"),
            "spec.runPolicy.cleanPodPolicies: KubeflowOrgV1RunPolicy has no such field",
        ),
        ("pytorchjob", lambda job: job["spec"]["runPolicy"].update(backoffLimit="2"), "'2' is not of type int"),
        ("pytorchjob", lambda job: _spec(job)["containers"][0].pop("image"), "containers[0].image: must be required"),
        (
            "pytorchjob",
            lambda job: _spec(job)["containers"][0].update(name="trainer"),
            "must have a container named pytorch",
        ),
        (
            "pytorchjob",
            lambda job: _spec(job)["containers"][0]["ports"][0].update(containerPort="29500"),
            "containers[0].ports[0].containerPort: '29500' is not of type int",
        ),
        (
            "pytorchjob",
            lambda job: job["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
            "Master.replicas: must be 1",
        ),
        ("pytorchjob", lambda job: job["metadata"].update(name="2-dlrm"), "is not an RFC 1035 label"),
        (
            "pytorchjob",
            lambda job: _spec(job)["containers"][0]["resources"]["requests"].update({"nvidia.com/gpu": "4"}),
            "requests.nvidia.com/gpu 4 must equal limits.nvidia.com/gpu 8",
        ),
        (
            "trainer",
            lambda job: job["spec"]["trainer"].update(numNodes="2"),
            "numNodes: Input should be a valid integer",
        ),
        (
            "trainer",
            lambda job: runtime_pod(job)["spec"].update(priorityClassName="high"),
            "TrainerV1alpha1PodSpecPatch has no such field",
        ),
        (
            "trainer",
            lambda job: job["spec"]["trainer"]["env"].append({"name": "PET_MASTER_ADDR", "value": "x"}),
            "must not have reserved envs ['PET_MASTER_ADDR']",
        ),
        ("trainer", lambda job: job["spec"]["runtimeRef"].pop("name"), "name: Input should be a valid string"),
        (
            "pytorchjob",
            lambda job: job["metadata"]["labels"].update({"torchx.pytorch.org/app-name": "run."}),
            "metadata.labels[torchx.pytorch.org/app-name]: 'run.' is not a label value",
        ),
        (
            "trainer",
            lambda job: runtime_pod(job)["metadata"]["labels"].update({"app.kubernetes.io/name": "run_"}),
            "'run_' is not a label value",
        ),
        (
            "pytorchjob",
            lambda job: _spec(job)["volumes"].append({"name": "m", "configMap": {"name": "Bad_Name"}}),
            "spec.volumes[m]: 'Bad_Name' is not a DNS-1123 subdomain",
        ),
        (
            "pytorchjob",
            lambda job: _spec(job)["volumes"].append({"name": "m", "hostPath": {"path": "/data/../etc"}}),
            "hostPath.path '/data/../etc': must not contain '..'",
        ),
        (
            "pytorchjob",
            lambda job: _spec(job)["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"}),
            "mountPath '/dev/shm' must be unique",
        ),
        (
            "trainer",
            lambda job: runtime_pod(job)["spec"]["containers"][0]["volumeMounts"].append(
                {"name": "m", "mountPath": "d"}
            ),
            "mountPath 'd' is not absolute",
        ),
        ("trainer", lambda job: job["spec"]["trainer"].update(image="my image"), "'my image': the kubelet refuses it"),
    ],
)
def test_validation_refuses_what_the_api_server_and_the_operators_would(api, break_it, fragment):
    job = manifest({"api": api}, *TRAIN_2X8)
    break_it(job)
    errors = (validate_pytorchjob if api == "pytorchjob" else validate_trainjob)(job)
    assert any(fragment in error for error in errors), errors


@pytest.mark.unit
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RESPONSES, "*.json"))), ids=os.path.basename)
def test_replayed_responses_are_objects_the_operators_models_accept(path):
    with open(path) as f:
        response = json.load(f)
    assert validate_recorded(response, "PyTorchJob" if "pytorchjob" in path else "TrainJob") == []


# ── the verbs, against a Kubernetes API ─────────────────────────────────────────────────────


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> FakeCluster:
    """A Kubernetes API with both operators' CRDs on loopback; KUBECONFIG points at it."""
    with fake_cluster() as api:
        monkeypatch.setenv("KUBECONFIG", api.kubeconfig(str(tmp_path / "kubeconfig")))
        yield api


def submit(cfg: dict, *component_args: str) -> str:
    """Submits through TorchX's runner; returns the handle."""
    info = get_runner().dryrun_component("components.dlrm:train", list(component_args), "kubeflow", cfg=cfg)
    return get_runner().schedule(info)


def job_of(handle: str) -> tuple[str, str, str]:
    """(plural, namespace, name) of the job behind a handle."""
    namespace, kind, name = handle.rpartition("/")[2].split(":")
    return f"{kind}s", namespace, name


def test_run_creates_the_object_that_status_describe_and_list_then_report(cluster):
    result = torchx("run", "-s", "kubeflow", "-cfg", "api=pytorchjob,queue=dlrm", "components.dlrm:train", "-j", "2x1")
    assert result.returncode == 0, result.stderr
    handle = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"kubeflow://torchx/default:pytorchjob:dlrm-[a-z0-9]{8}", handle), result.stdout
    plural, namespace, name = job_of(handle)
    (created,) = cluster.sent("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs")
    assert validate_pytorchjob(created.body) == [] and created.body["metadata"]["name"] == name
    # The trainers know the handle the user got, and their rendezvous is keyed by it.
    (container,) = created.body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert env(container)["TORCHX_JOB_ID"] == handle
    assert f"--rdzv_id '{namespace}:pytorchjob:{name}'" in command(container)

    status = torchx("status", "--json", handle)
    assert json.loads(status.stdout)["state"] == "SUBMITTED", status.stderr

    cluster.operator_writes(plural, namespace, name, "pytorchjob_running")
    reported = json.loads(torchx("status", "--json", handle).stdout)
    assert (reported["state"], reported["msg"]) == ("RUNNING", f"PyTorchJob default/{name} is running.")
    (role,) = reported["roles"]
    assert [(r["id"], r["hostname"]) for r in role["replicas"]] == [
        (0, "ip-10-0-1-11.us-west-2.compute.internal"),
        (1, "ip-10-0-1-12.us-west-2.compute.internal"),
    ]

    described = torchx("describe", handle)
    assert described.returncode == 0, described.stderr
    assert "'name': 'train'" in described.stdout and "'num_replicas': 2" in described.stdout

    # A PyTorchJob created without TorchX is not listed.
    foreign = json.loads(json.dumps(created.body))
    foreign["metadata"] = {"name": "hand-made", "namespace": "default", "labels": {}}
    cluster.objects[(plural, namespace, "hand-made")] = foreign
    listed = torchx("list", "-s", "kubeflow")
    assert listed.returncode == 0, listed.stderr
    assert [line.split() for line in listed.stdout.splitlines()[2:]] == [[handle, "dlrm", "RUNNING"]]


@pytest.mark.parametrize(
    "recorded, state, message, replica_states, restarts",
    [
        ("pytorchjob_suspended", S.PENDING, "PyTorchJob <name> is suspended.", [S.PENDING, S.PENDING], 0),
        ("pytorchjob_created", S.PENDING, "PyTorchJob <name> is created.", [S.PENDING, S.PENDING], 0),
        ("pytorchjob_running", S.RUNNING, "PyTorchJob default/<name> is running.", [S.RUNNING, S.RUNNING], 0),
        (
            "pytorchjob_restarting",
            S.RUNNING,
            "PyTorchJob <name> is restarting because 1 Worker replica(s) failed.",
            [S.RUNNING, S.RUNNING],
            1,
        ),
        (
            "pytorchjob_succeeded",
            S.SUCCEEDED,
            "PyTorchJob default/<name> successfully completed.",
            [S.SUCCEEDED, S.SUCCEEDED],
            0,
        ),
        (
            "pytorchjob_failed",
            S.FAILED,
            "PyTorchJob <name> is failed because 1 Worker replica(s) failed.",
            [S.FAILED, S.FAILED],
            0,
        ),
        ("trainjob_suspended", S.PENDING, "TrainJob is suspended", [S.PENDING, S.PENDING], 0),
        ("trainjob_starting", S.PENDING, "waiting for all the job's pods to start", [S.RUNNING, S.PENDING], 0),
        ("trainjob_running", S.RUNNING, "", [S.RUNNING, S.RUNNING], 0),
        ("trainjob_complete", S.SUCCEEDED, "jobset completed successfully", [S.SUCCEEDED, S.SUCCEEDED], 0),
        ("trainjob_failed", S.FAILED, "jobset failed due to one or more job failures", [S.FAILED, S.FAILED], 1),
    ],
)
def test_status_follows_what_the_operator_writes(cluster, recorded, state, message, replica_states, restarts):
    api = "trainer" if recorded.startswith("trainjob") else "pytorchjob"
    handle = submit({"api": api, "queue": "dlrm"}, "-j", "2x1")
    plural, namespace, name = job_of(handle)
    cluster.operator_writes(plural, namespace, name, recorded)
    status = get_runner().status(handle)
    assert (status.state, status.msg) == (state, message.replace("<name>", name))
    (role,) = status.roles
    assert [replica.state for replica in role.replicas] == replica_states
    assert status.num_restarts == restarts


def test_log_reads_each_replicas_pod_filtered_and_followed(cluster):
    result = torchx("run", "-s", "kubeflow", "-cfg", "api=pytorchjob", "components.dlrm:train", "-j", "2x1")
    handle = result.stdout.strip().splitlines()[-1]
    plural, namespace, name = job_of(handle)
    cluster.operator_writes(plural, namespace, name, "pytorchjob_running")

    logged = torchx("log", "--regex", "step 100/", f"{handle}/train")
    assert logged.returncode == 0, logged.stderr
    assert sorted(logged.stdout.splitlines()) == [
        "train/0 [rank 0] step 100/6000 loss 0.1403 lr 15.0 examples/s 1.91e+06",
        "train/1 [rank 8] step 100/6000 loss 0.1405",
    ]
    assert {r.query["container"] for r in cluster.sent("GET", "/log")} == {"pytorch"}

    # --tail follows the trainer container's log; `until` stops at a time (the API writes timestamps).
    runner = get_runner()
    followed = list(runner.log_lines(handle, "train", 1, should_tail=True))
    assert followed[-1] == "[rank 8] step 100/6000 loss 0.1405\n"
    assert cluster.sent("GET", f"/pods/{name}-worker-0/log")[-1].query["follow"] == "true"
    until = datetime(2026, 11, 23, 10, 3, tzinfo=timezone.utc)
    assert [line.split()[-1] for line in runner.log_lines(handle, "train", 0, until=until)] == ["eth0", "1.91e+06"]


def test_log_of_a_replica_whose_pod_is_not_there_says_why(cluster):
    handle = submit({**PYTORCHJOB, "queue": "dlrm"}, "-j", "2x1")
    cluster.operator_writes(*job_of(handle), "pytorchjob_suspended")
    no_pod = r"replica 1 of PyTorchJob default/dlrm-\w+ has no pod yet \(the job is PENDING\): try again once it runs"
    with pytest.raises(ValueError, match=no_pod):
        list(get_runner().log_lines(handle, "train", 1))
    with pytest.raises(ValueError, match="runs role `train` with replicas 0 to 1, not `trainer` 0: use train/0"):
        list(get_runner().log_lines(handle, "trainer", 0))


def test_cancel_deletes_the_job_in_the_foreground(cluster):
    handle = submit(PYTORCHJOB, "-j", "2x1")
    plural, namespace, name = job_of(handle)
    cluster.operator_writes(plural, namespace, name, "pytorchjob_running")
    cancelled = torchx("cancel", handle)
    assert cancelled.returncode == 0, cancelled.stderr
    (delete,) = cluster.sent("DELETE", "")
    assert delete.path == f"/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/{name}"
    assert delete.query["propagationPolicy"] == "Foreground"
    # The object stays until the operator's pods are gone: the job reads CANCELLED meanwhile...
    assert get_runner().status(handle).state == S.CANCELLED
    # ...and then is gone.
    cluster.finish_deletion(plural, namespace, name)
    gone = torchx("status", handle)
    assert gone.returncode == 1 and "does not exist" in gone.stderr


def test_trainjob_is_submitted_followed_logged_and_cancelled_through_the_trainer_api(cluster):
    result = torchx("run", "-s", "kubeflow", "-cfg", "api=trainer,queue=dlrm", "components.dlrm:train", "-j", "2x1")
    assert result.returncode == 0, result.stderr
    handle = result.stdout.strip().splitlines()[-1]
    plural, namespace, name = job_of(handle)
    assert plural == "trainjobs"
    (created,) = cluster.sent("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs")
    assert validate_trainjob(created.body) == []

    cluster.operator_writes(plural, namespace, name, "trainjob_running")
    assert get_runner().status(handle).state == S.RUNNING
    logged = torchx("log", f"{handle}/train/0")
    assert logged.returncode == 0, logged.stderr
    assert logged.stdout.splitlines()[-1] == "train/0 [rank 0] step 100/6000 loss 0.1403"
    assert cluster.sent("GET", f"/pods/{name}-node-0-0-x7k2p/log")[0].query["container"] == "node"

    assert torchx("cancel", handle).returncode == 0
    assert cluster.sent("DELETE", f"/trainjobs/{name}")[0].query["propagationPolicy"] == "Foreground"


def test_a_cluster_without_the_operator_is_named_as_the_cause(cluster):
    del cluster.kinds[("kubeflow.org", "v1", "pytorchjobs")]
    result = torchx("run", "-s", "kubeflow", "-cfg", "api=pytorchjob", "components.dlrm:train")
    assert result.returncode != 0
    assert (
        "creating PyTorchJob default/dlrm-" in result.stderr
        and "404 Not Found: the server could not find the "
        "requested resource: is the PyTorchJob API installed? (kubectl get crd pytorchjobs.kubeflow.org)"
        in result.stderr
    ), result.stderr[-2000:]
    with pytest.raises(KubeflowApiError, match=re.escape("is the PyTorchJob API installed?")):
        get_runner().status("kubeflow://torchx/default:pytorchjob:dlrm-bx3k9w2q")
    # TorchX's jobs of the other operator are still listed.
    handle = submit({"api": "trainer"}, "-j", "2x1")
    assert [app.app_handle for app in get_runner().list("kubeflow")] == [handle]


def test_refused_credentials_are_reported_without_showing_them(cluster, tmp_path):
    kubeconfig = yaml.safe_load(open(os.environ["KUBECONFIG"]))
    kubeconfig["users"][0]["user"]["token"] = leaked = "s3cr3t-token-of-another-cluster"
    path = tmp_path / "other-kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    result = torchx("status", "kubeflow://torchx/default:pytorchjob:dlrm-bx3k9w2q", KUBECONFIG=str(path))
    assert result.returncode == 1
    assert "reading PyTorchJob default/dlrm-bx3k9w2q: the Kubernetes API answered 401 Unauthorized" in result.stderr
    assert leaked not in result.stdout + result.stderr and TOKEN not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "handle, fragment",
    [
        ("kubeflow://torchx/dlrm-bx3k9w2q", "`dlrm-bx3k9w2q` is not a kubeflow app id: expected NAMESPACE:KIND:NAME"),
        ("kubeflow://torchx/default:tfjob:dlrm-bx3k9w2q", "with KIND one of pytorchjob, trainjob"),
    ],
)
def test_a_handle_that_is_not_a_kubeflow_one_says_what_one_looks_like(cluster, handle, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        get_runner().status(handle)


@pytest.mark.unit
def test_without_a_kubeconfig_the_error_says_where_kubectls_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SetupError, match="finds no Kubernetes cluster to talk to in KUBECONFIG=.*: set KUBECONFIG to"):
        get_runner().status("kubeflow://torchx/default:pytorchjob:dlrm-bx3k9w2q")


@pytest.mark.unit
def test_trainers_command_line_is_shell_text_that_keeps_the_app_id_quoted():
    # The namespace is part of the app id, which TorchX writes into `bash -c`: it can hold no shell syntax.
    job = manifest({**PYTORCHJOB, "namespace": "ml-team"}, "-j", "2x1")
    (container, _) = containers(job)
    words = shlex.split(command(container))
    assert words[words.index("--rdzv_id") + 1] == f"ml-team:pytorchjob:{job['metadata']['name']}"
