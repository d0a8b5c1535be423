"""``torchx run --dryrun`` prints, for each scheduler, the request a cluster would accept.

The request for a 2-node p4d job is generated through TorchX's CLI, as a user runs it, and
compared with a reviewed golden file under tests/golden/ (run-to-run values replaced by
placeholders; UPDATE_GOLDEN=1 rewrites them). The Volcano job is also validated offline
against a schema of the Volcano Job API and the Kubernetes client's pod models, and the Kubeflow
PyTorchJob and TrainJob against the operators' published models, since no API server can run
here; the sbatch script is parsed by bash. The requests of export and predict (docs/serving.md)
are checked the same way on every cluster scheduler, and against AWS Batch's API model.
"""

import ast
import copy
import json
import os
import re
import shutil
import subprocess
from typing import Any

import botocore.session
import pytest
import torchx
import yaml
from botocore.validate import ParamValidator
from torchx.runner import get_runner

from tests.conftest import BIN, process_env
from tests.golden_files import assert_matches_golden
from tests.kubeflow_validation import validate_pytorchjob, validate_trainjob
from tests.volcano_validation import policy_errors, validate_volcano_job

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

#: The job of the golden files: a 2-node p4d job (any app's training component's, after it).
JOB_2X8 = ["-j", "2x8", "-h", "aws_p4d.24xlarge", "--batch_size", "8192"]
KUBERNETES_CFG = "queue=dlrm,service_account=dlrm-trainer,validate_spec=False"
#: The runner's run options of a Volcano dry run without a cluster.
KUBERNETES_DRYRUN_CFG = {"queue": "dlrm", "validate_spec": False}
KUBEFLOW_CFG = "queue=dlrm,service_account=dlrm-trainer"
_SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def dryrun(cwd, scheduler: str, *options: str, component: str = "components.dlrm:train") -> str:
    """The SCHEDULER REQUEST part of ``torchx run --dryrun``'s output for ``component``'s 2-node
    p4d job, run in ``cwd``."""
    return dryrun_process(cwd, scheduler, *options, component=component).stdout.split("=== SCHEDULER REQUEST ===\n", 1)[
        1
    ]


def dryrun_process(cwd, scheduler: str, *options: str, component: str) -> subprocess.CompletedProcess:
    """``torchx run --dryrun`` of ``component``'s 2-node p4d job in ``cwd``, which succeeded."""
    env = process_env()
    env.pop("LOGLEVEL", None)  # dist.torchrun copies it into the job's environment
    result = subprocess.run(
        [os.path.join(BIN, "torchx"), "run", "--dryrun", "-s", scheduler, *options, component, *JOB_2X8],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def normalised(text: str, **placeholders: str) -> str:
    """``text`` with run-to-run values replaced: ``placeholders`` maps a placeholder to its value."""
    for placeholder, value in placeholders.items():
        text = text.replace(value, f"<{placeholder.replace('_', '-')}>")
    text = _SESSION_ID.sub("<session-id>", text)
    return text.replace(torchx.__version__, "<torchx-version>")


def test_local_cwd_runs_both_nodes_here(tmp_path):
    request = ast.literal_eval(dryrun(tmp_path, "local_cwd"))
    log_root = request["log_dir"].rsplit("/torchx/", 1)[0]
    text = json.dumps(request, indent=2) + "\n"
    # The job's PATH begins with the folder of torchx's Python (schedulers/local.py).
    text = normalised(text, log_dir=log_root, app_id=request["app_id"], cwd=str(tmp_path), python_bin=BIN)
    assert_matches_golden("local_cwd_train_2x8_p4d.json", text)
    replicas = request["role_params"]["train"]
    assert len(replicas) == 2 and {r["cwd"] for r in replicas} == {str(tmp_path)}


def test_slurm_sbatch_script_is_a_valid_heterogeneous_job(tmp_path):
    command, script = dryrun(tmp_path, "slurm").split("\n#----------------\n# SBATCH_SCRIPT\n#----------------\n")
    assert command.strip() == "sbatch --parsable $SBATCH_SCRIPT"
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert_matches_golden("slurm_train_2x8_p4d.sh", normalised(script))
    # one part per node, each a whole p4d with its 8 GPUs
    parts = [line for line in script.splitlines() if line.startswith("#SBATCH --job-name")]
    assert len(parts) == 2 and all("--gpus-per-task=8" in part for part in parts)


def test_a_slurm_dry_run_off_the_cluster_prints_no_warning_of_the_missing_sinfo(tmp_path):
    assert shutil.which("sinfo", path=process_env()["PATH"]) is None  # as off a Slurm login node
    result = dryrun_process(tmp_path, "slurm", "-cfg", "partition=gpu,time=1:00:00", component="components.dlrm:train")
    assert "Warning" not in result.stderr, result.stderr[-4000:]
    assert "--gpus-per-task=8" in result.stdout  # TorchX's request for Slurm before 24.11, as it assumes


@pytest.fixture(scope="module")
def volcano_job(tmp_path_factory) -> str:
    return dryrun(tmp_path_factory.mktemp("k8s"), "kubernetes", "-cfg", KUBERNETES_CFG, "--workspace", "")


def test_kubernetes_volcano_job_is_valid_and_complete(volcano_job):
    job = yaml.safe_load(volcano_job)
    assert validate_volcano_job(job) == []
    assert job["spec"]["queue"] == "dlrm" and job["spec"]["schedulerName"] == "volcano"
    assert [task["name"] for task in job["spec"]["tasks"]] == ["train-0", "train-1"]
    for task in job["spec"]["tasks"]:
        pod = task["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"
        assert {"mountPath": "/dev/shm", "name": "dshm"} in container["volumeMounts"]
        assert {"emptyDir": {"medium": "Memory"}, "name": "dshm"} in pod["volumes"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
        assert pod["serviceAccountName"] == "dlrm-trainer"
    # Dumped again without line wrapping: the printed YAML wraps long commands where the app id's
    # length puts them, and the golden file should read as one command per line.
    text = normalised(json.dumps(job), app_id=job["metadata"]["name"])
    assert_matches_golden("kubernetes_train_2x8_p4d.yaml", yaml.safe_dump(json.loads(text), width=1000))


@pytest.mark.parametrize(
    "api, validate, golden",
    [
        ("pytorchjob", validate_pytorchjob, "kubeflow_train_2x8_p4d.yaml"),
        ("trainer", validate_trainjob, "kubeflow_trainer_train_2x8_p4d.yaml"),
    ],
)
def test_kubeflow_job_is_valid_against_the_operators_models(tmp_path, api, validate, golden):
    text = dryrun(tmp_path, "kubeflow", "-cfg", f"api={api},{KUBEFLOW_CFG}")
    job = yaml.safe_load(text)
    assert validate(job) == []
    assert_matches_golden(golden, normalised(text.rstrip() + "\n", name=job["metadata"]["name"]))


def _spec(job):
    return job["spec"]["tasks"][0]["template"]["spec"]


@pytest.mark.parametrize(
    "break_it, fragment",
    [
        (lambda job: _spec(job).update(nodeSelecter={"a": "b"}), "changes in a round trip through V1PodTemplateSpec"),
        (lambda job: job["spec"].update(queue=5), "spec.queue: 5 is not of type 'string'"),
        (lambda job: job["spec"].update(maxRetry=-1), "spec.maxRetry: -1 is less than the minimum"),
        (lambda job: _spec(job)["containers"][0].pop("name"), "not a V1PodTemplateSpec"),
        (lambda job: _spec(job)["containers"][0]["ports"][0].update(containerPort="29500"), "not a V1PodTemplateSpec"),
        (
            lambda job: _spec(job)["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": "8 GPUs"}),
            "'8 GPUs' is not a Kubernetes quantity",
        ),
        (
            lambda job: _spec(job)["containers"][0]["resources"]["requests"].update(cpu="97"),
            "requests.cpu 97 exceeds limits.cpu",
        ),
        (
            lambda job: _spec(job)["containers"][0]["resources"]["requests"].update({"nvidia.com/gpu": "4"}),
            "requests.nvidia.com/gpu 4 must equal limits.nvidia.com/gpu 8",
        ),
        (lambda job: job["spec"]["tasks"][0].update(name="t" * 60), "longer than 63 characters"),
        (lambda job: job["metadata"].update(name="DLRM_job"), "not a DNS-1123 label"),
        (
            lambda job: job["spec"]["tasks"][0]["template"]["metadata"]["labels"].update(
                {"app.kubernetes.io/name": "run."}
            ),
            "metadata.labels[app.kubernetes.io/name]: 'run.' is not a label value",
        ),
    ],
)
def test_volcano_validation_refuses_what_a_cluster_would(volcano_job, break_it, fragment):
    job = copy.deepcopy(yaml.safe_load(volcano_job))
    break_it(job)
    errors = validate_volcano_job(job)
    assert any(fragment in error for error in errors), errors


@pytest.mark.unit
def test_a_volcano_job_with_retries_ends_on_a_refusal_and_restarts_on_other_failures():
    # TorchX's retry policies restart the whole job on any failed pod: a refused option or data
    # (the launcher exits 2) would fail again on every attempt. Volcano applies a task's first
    # matching policy, so the refusal's comes first.
    request = (
        get_runner()
        .dryrun_component(
            "components.dlrm:train", ["-j", "2x2", "--max_retries", "2"], "kubernetes", cfg=KUBERNETES_DRYRUN_CFG
        )
        .request
    )
    job = yaml.safe_load(str(request))
    assert validate_volcano_job(job) == []
    for task in job["spec"]["tasks"]:
        assert task["policies"][0] == {"exitCode": 2, "action": "TerminateJob"}
        assert {"event": "PodFailed", "action": "RestartJob"} in task["policies"][1:]
    assert policy_errors([{"event": "PodFailed", "exitCode": 2, "action": "AbortJob"}], "p")  # the webhook's rules
    assert policy_errors([{"exitCode": 0, "action": "AbortJob"}, {"event": "PodFailed", "action": "Sync"}], "p")


@pytest.mark.parametrize("name", ["run.", "ctr/run-", "a_b_", "x" * 62 + "_y"])
def test_volcano_jobs_of_names_ending_in_what_a_label_value_cannot_end_in_are_valid(name):
    # TorchX writes the app's name into the job's and pods' labels as it is, and its pods' names.
    request = (
        get_runner()
        .dryrun_component("components.dlrm:train", ["--name", name], "kubernetes", cfg=KUBERNETES_DRYRUN_CFG)
        .request
    )
    job = yaml.safe_load(str(request))
    assert validate_volcano_job(job) == []
    labels = job["spec"]["tasks"][0]["template"]["metadata"]["labels"]
    given = name.rpartition("/")[2]
    app_name = labels["torchx.pytorch.org/app-name"]
    assert app_name == given.strip("-_.") if len(given) < 40 else given.startswith(app_name), app_name
    env = {v["name"]: v["value"] for v in job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["env"]}
    assert env["TORCHX_TRACKING_RUN_NAME"] == name.rpartition("/")[2]  # the job's own name, as given


# --- after training: export and predict, as docs/serving.md submits them ------------------------

SERVING = {
    "apps.dlrm.export": ["--checkpoint_dir", "s3://b/ckpt", "--output", "s3://b/pkg", "--quantize", "int8"],
    "apps.dlrm.predict": [
        "-j", "2x4", "--model", "s3://b/pkg", "--data", "criteo_tsv", "--data_path", "s3://b/logs/",
        "--output", "s3://b/scores/", "--passthrough_columns", "row,label",
    ],
}  # fmt: skip


def serving_request(scheduler: str, module: str, **cfg: object) -> Any:
    """The request ``torchx run --dryrun -s SCHEDULER components.dlrm:export|predict ...`` renders."""
    component = f"components.dlrm:{module.rsplit('.', 1)[1]}"
    return get_runner().dryrun_component(component, SERVING[module], scheduler, cfg=cfg).request


def batch_errors(operation: str, params: dict) -> str:
    """Every field of ``params`` that AWS Batch's API model does not take ("" if none)."""
    batch = botocore.session.get_session().get_service_model("batch")
    report = ParamValidator().validate(params, batch.operation_model(operation).input_shape)
    return report.generate_report() if report.has_errors() else ""


@pytest.mark.unit
@pytest.mark.parametrize("module", list(SERVING))
def test_export_and_predict_requests_are_valid_on_every_cluster_scheduler(module):
    script = serving_request("slurm", module).materialize()
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0 and module in script, syntax.stderr

    volcano = yaml.safe_load(str(serving_request("kubernetes", module, queue="dlrm", validate_spec=False)))
    assert validate_volcano_job(volcano) == [] and module in json.dumps(volcano)

    for api, validate in (("pytorchjob", validate_pytorchjob), ("trainer", validate_trainjob)):
        job = serving_request("kubeflow", module, queue="dlrm", api=api).resource
        assert validate(job) == [] and module in json.dumps(job)

    batch = serving_request("aws_batch", module, queue="dlrm", user="alice")
    assert batch_errors("RegisterJobDefinition", batch.job_definition) == ""
    assert batch_errors("SubmitJob", batch.job) == "" and module in json.dumps(batch.job_definition)
