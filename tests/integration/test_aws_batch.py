"""``-s aws_batch`` end to end: dry run, submit, status, list, log, cancel.

A real AWS API (moto's server on loopback, testing/moto_server.py) plays AWS Batch and CloudWatch
Logs. moto's Batch runs no containers: a job SUCCEEDS as soon as it is submitted and writes no
logs, so the log test writes the node's log events itself, where Batch's awslogs driver would.
"""

import json
import os

import boto3
import botocore.session
import pytest
from botocore.validate import ParamValidator
from torchx import specs
from torchx.runner import get_runner

from schedulers.aws_batch import CANCEL_REASON, LOG_GROUP, AWSBatchScheduler
from testing.moto_server import _post as post
from tests.conftest import BIN, run
from tests.golden_files import assert_matches_golden

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

QUEUE = "dlrm-queue"


def torchx(*args: str):
    return run([os.path.join(BIN, "torchx"), *args], timeout=120)


@pytest.fixture(params=["name", "arn"], ids=lambda given: f"queue-{given}")
def queue(request, aws):
    """An EC2 compute environment (multi-node jobs need EC2) and a job queue on the loopback AWS,
    given as `-cfg queue=` takes it: by name or by ARN (app handles carry the name either way)."""
    iam, ec2, batch = boto3.client("iam"), boto3.client("ec2"), boto3.client("batch")
    service_role = iam.create_role(RoleName="batch-service", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    instance_profile = iam.create_instance_profile(InstanceProfileName="ecs-instance")["InstanceProfile"]["Arn"]
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    security_group = ec2.create_security_group(GroupName="nodes", Description="nodes", VpcId=vpc)["GroupId"]
    batch.create_compute_environment(
        computeEnvironmentName="dlrm-ec2",
        type="MANAGED",
        state="ENABLED",
        serviceRole=service_role,
        computeResources={
            "type": "EC2",
            "minvCpus": 0,
            "maxvCpus": 64,
            "instanceTypes": ["optimal"],
            "subnets": [subnet],
            "securityGroupIds": [security_group],
            "instanceRole": instance_profile,
        },
    )
    created = batch.create_job_queue(
        jobQueueName=QUEUE,
        state="ENABLED",
        priority=1,
        computeEnvironmentOrder=[{"order": 1, "computeEnvironment": "dlrm-ec2"}],
    )
    return created["jobQueueArn"] if request.param == "arn" else QUEUE


@pytest.fixture
def submitted(queue):
    """The handle of a 2-node training job submitted with `torchx run -s aws_batch`."""
    result = torchx(
        "run",
        "-s",
        "aws_batch",
        "-cfg",
        f"queue={queue}",
        "--workspace",
        "",
        "components.dlrm:train",
        "-j",
        "2x1",
        "--steps",
        "10",
    )
    assert result.returncode == 0, result.stderr
    handle = result.stdout.strip().splitlines()[-1]
    assert handle.startswith(f"aws_batch://torchx/{QUEUE}:dlrm-"), result.stdout
    return handle


def batch_job(handle: str) -> dict:
    """The job behind a handle, as Batch describes it."""
    queue, name = handle.rpartition("/")[2].split(":")
    batch = boto3.client("batch")
    (summary,) = batch.list_jobs(jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [name]}])["jobSummaryList"]
    return batch.describe_jobs(jobs=[summary["jobId"]])["jobs"][0]


def status(handle: str) -> dict:
    result = torchx("status", "--json", handle)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_run_submits_a_multi_node_job_that_status_and_list_report(submitted, queue):
    job = batch_job(submitted)
    nodes = job["nodeProperties"]
    assert (nodes["numNodes"], nodes["mainNode"]) == (2, 0)
    (node_range,) = nodes["nodeRangeProperties"]
    assert node_range["targetNodes"] == "0:1"
    command = node_range["container"]["command"][2]
    assert "--nnodes 2 --nproc_per_node 1" in command
    # Nodes 1.. find the rendezvous on the main node; the main node falls back to localhost.
    assert "${AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS:=localhost}:29500" in command
    env = {e["name"]: e["value"] for e in node_range["container"]["environment"]}
    assert env["TORCHX_JOB_ID"] == submitted  # the trainers know the handle the user got

    reported = status(submitted)
    assert reported["state"] == "SUCCEEDED"  # moto's Batch finishes jobs at once
    (role,) = reported["roles"]
    assert role["role"] == "train"
    succeeded = specs.AppState.SUCCEEDED
    assert [(r["id"], r["state"]) for r in role["replicas"]] == [(0, succeeded), (1, succeeded)]

    # A job submitted outside TorchX is not listed.
    batch = boto3.client("batch")
    batch.register_job_definition(
        jobDefinitionName="other", type="container", containerProperties={"image": "busybox", "vcpus": 1, "memory": 128}
    )
    batch.submit_job(jobName="other", jobQueue=queue, jobDefinition="other")
    listed = torchx("list", "-s", "aws_batch", "-cfg", f"queue={queue}")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[2:]]
    assert rows == [[submitted, "dlrm", "SUCCEEDED"]]
    # Without a queue, every queue is searched.
    assert torchx("list", "-s", "aws_batch").stdout == listed.stdout


def test_log_reads_the_nodes_cloudwatch_stream(submitted):
    attempt = batch_job(submitted)["attempts"][-1]
    stream = attempt["container"]["logStreamName"]
    logs = boto3.client("logs")
    logs.create_log_group(logGroupName=LOG_GROUP)
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    lines = ["step 10 loss 0.51", "validation: auroc 0.77", "wrote outputs/summary.json"]
    logs.put_log_events(
        logGroupName=LOG_GROUP,
        logStreamName=stream,
        logEvents=[{"timestamp": attempt["startedAt"] + i, "message": line} for i, line in enumerate(lines)],
    )

    def logged(*args: str) -> list[str]:
        result = torchx("log", *args)
        assert result.returncode == 0, result.stderr
        prefixed = [line.split(" ", 1) for line in result.stdout.splitlines()]
        assert all("train/0" in prefix for prefix, _ in prefixed), result.stdout
        return [message for _, message in prefixed]

    assert logged(f"{submitted}/train/0") == lines
    assert logged("--tail", f"{submitted}/train/0") == lines  # the job has ended: no waiting
    assert logged("--regex", "auroc", f"{submitted}/train/0") == ["validation: auroc 0.77"]

    # Node 1 has no child job on moto's Batch, so it has no stream to read yet: nothing, no error.
    scheduler = AWSBatchScheduler("torchx")
    app_id = submitted.rpartition("/")[2]
    assert list(scheduler.log_iter(app_id, "train", k=1)) == []
    with pytest.raises(ValueError, match="has replicas 0 to 1, not 2"):
        scheduler.log_iter(app_id, "train", k=2)
    with pytest.raises(ValueError, match="has no role `eval`; its roles: train"):
        scheduler.log_iter(app_id, "eval")


@pytest.fixture
def queued_jobs_stay_queued(moto_endpoint):
    """Jobs wait in the queue (SUBMITTED) for a minute instead of finishing at once.

    moto's Docker-less Batch finishes every job as it is submitted, and TorchX cancels only
    jobs that have not finished; its Docker-based Batch moves a job on through moto's state
    manager, here once a minute, and fails it only when it reaches the point of starting a
    container, long after this test.
    """
    post(moto_endpoint + "/moto-api/config", {"batch": {"use_docker": True}})
    post(
        moto_endpoint + "/moto-api/state-manager/set-transition",
        {"model_name": "batch::job", "transition": {"progression": "time", "seconds": 60}},
    )
    yield
    post(moto_endpoint + "/moto-api/state-manager/unset-transition", {"model_name": "batch::job"})
    post(moto_endpoint + "/moto-api/config", {"batch": {"use_docker": False}})


def test_cancel_terminates_a_queued_job(queue, queued_jobs_stay_queued):
    result = torchx(
        "run", "-s", "aws_batch", "-cfg", f"queue={queue}", "--workspace", "", "components.dlrm:train", "-j", "2x1"
    )
    assert result.returncode == 0, result.stderr
    handle = result.stdout.strip().splitlines()[-1]
    assert status(handle)["state"] == "SUBMITTED"

    result = torchx("cancel", handle)
    assert result.returncode == 0, result.stderr
    # Batch records the reason at once and fails the job when it stops it.
    assert batch_job(handle)["statusReason"] == CANCEL_REASON
    assert status(handle)["msg"] == CANCEL_REASON


def test_roles_become_node_ranges_with_their_own_resources_and_mounts(queue):
    image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/dlrm:1"
    trainer = specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", f"echo node {specs.macros.replica_id} of {specs.macros.app_id}"],
        num_replicas=2,
        resource=specs.resource(h="aws_p4d.24xlarge"),
        max_retries=2,
        mounts=specs.parse_mounts("type=bind,src=/fsx,dst=/data,readonly,type=volume,src=fs-0abc,dst=/ckpt".split(",")),
    )
    reader = specs.Role(
        name="reader",
        image=image,
        entrypoint="bash",
        args=["-c", f"echo reader {specs.macros.replica_id}"],
        num_replicas=1,
        resource=specs.resource(h="aws_p4d.24xlarge"),
    )
    cfg = {
        "queue": queue,
        "shm_size": 65536,
        "share_id": "recsys",
        "priority": 7,
        "job_role_arn": "arn:aws:iam::123456789012:role/dlrm-job",
    }
    with get_runner() as runner:
        dryrun = runner.dryrun(specs.AppDef("two-roles", roles=[trainer, reader]), "aws_batch", cfg)
        submit_job = dryrun.request.job
        assert (submit_job["shareIdentifier"], submit_job["schedulingPriorityOverride"]) == ("recsys", 7)
        handle = runner.schedule(dryrun)
        described = runner.describe(handle)

    assert [(r.name, r.num_replicas, r.resource.gpu) for r in described.roles] == [("trainer", 2, 8), ("reader", 1, 8)]
    job = batch_job(handle)
    assert job["nodeProperties"]["numNodes"] == 3
    (definition,) = boto3.client("batch").describe_job_definitions(jobDefinitions=[job["jobDefinition"]])[
        "jobDefinitions"
    ]
    # 2 retries, none after a refusal (exit 2: a configuration error every attempt would meet)
    retries = definition["retryStrategy"]
    assert retries["attempts"] == 3 and [(c["onExitCode"], c["action"].upper()) for c in retries["evaluateOnExit"]] == [
        ("2", "EXIT")  # Batch takes the action in any case
    ]
    trainer_nodes, reader_nodes = job["nodeProperties"]["nodeRangeProperties"]
    assert (trainer_nodes["targetNodes"], reader_nodes["targetNodes"]) == ("0:1", "2:2")
    # Replica ids count from each role's first node.
    assert (
        trainer_nodes["container"]["command"][2]
        == f"echo node $AWS_BATCH_JOB_NODE_INDEX of {handle.rpartition('/')[2]}"
    )
    assert reader_nodes["container"]["command"][2] == "echo reader $((AWS_BATCH_JOB_NODE_INDEX - 2))"

    container = trainer_nodes["container"]
    assert {r["type"]: r["value"] for r in container["resourceRequirements"]} == {
        "VCPU": "96",
        "MEMORY": "1132416",
        "GPU": "8",
    }
    assert container["instanceType"] == "p4d.24xlarge"
    assert container["jobRoleArn"] == cfg["job_role_arn"]
    assert container["linuxParameters"]["sharedMemorySize"] == 65536
    efa = [d["hostPath"] for d in container["linuxParameters"]["devices"]]
    assert efa == [f"/dev/infiniband/uverbs{i}" for i in range(4)]
    assert container["ulimits"] == [{"name": "memlock", "softLimit": -1, "hardLimit": -1}]
    volumes = {v["name"]: v for v in container["volumes"]}
    mounts = {m["containerPath"]: (volumes[m["sourceVolume"]], m["readOnly"]) for m in container["mountPoints"]}
    assert mounts["/data"][0]["host"] == {"sourcePath": "/fsx"} and mounts["/data"][1] is True
    assert mounts["/ckpt"][0]["efsVolumeConfiguration"] == {"fileSystemId": "fs-0abc"} and mounts["/ckpt"][1] is False


def _normalized(dryrun: dict) -> dict:
    """The request with what changes from run to run replaced by placeholders."""
    request = dryrun["request"]
    name = request["job"]["jobName"]
    text = json.dumps({"registerJobDefinition": request["job_definition"], "submitJob": request["job"]}, indent=2)
    normalized = json.loads(text.replace(name, "<job-name>"))
    for node_range in normalized["registerJobDefinition"]["nodeProperties"]["nodeRangeProperties"]:
        for variable in node_range["container"]["environment"]:
            if variable["name"] == "TORCHX_INTERNAL_SESSION_ID":
                variable["value"] = "<session-id>"
    for tags in (normalized["registerJobDefinition"]["tags"], normalized["submitJob"]["tags"]):
        tags["torchx.pytorch.org/version"] = "<torchx-version>"
    return normalized


def test_dryrun_prints_the_reviewed_multi_node_job_definition(monkeypatch):
    monkeypatch.delenv("LOGLEVEL", raising=False)  # dist.torchrun copies it into the job's env
    result = torchx(
        "run",
        "--dryrun",
        "--json",
        "-s",
        "aws_batch",
        "-cfg",
        f"queue={QUEUE},user=alice",
        "--workspace",
        "",
        "components.dlrm:train",
        "-j",
        "2x8",
        "-h",
        "aws_p4d.24xlarge",
        "--batch_size",
        "8192",
    )  # the job of the other schedulers' golden files (test_dryrun.py)
    assert result.returncode == 0, result.stderr
    request = _normalized(json.loads(result.stdout))

    # Every field is one Batch's API model knows, with the right type.
    batch = botocore.session.get_session().get_service_model("batch")
    for operation, params in [
        ("RegisterJobDefinition", request["registerJobDefinition"]),
        ("SubmitJob", request["submitJob"]),
    ]:
        report = ParamValidator().validate(params, batch.operation_model(operation).input_shape)
        assert not report.has_errors(), report.generate_report()

    assert_matches_golden("aws_batch_train_2x8_p4d.json", json.dumps(request, indent=2) + "\n")


@pytest.mark.parametrize(
    "cfg, component_args, fragment",
    [
        ("user=alice", [], "Required run option: queue"),
        (f"queue={QUEUE}", ["-j", "1:2x1"], "fixed node count: use -j 2xNPROC"),
        (f"queue={QUEUE}", ["--max_retries", "10"], "at most 9 retries"),
        (f"queue={QUEUE},priority=5", [], "priority=5 needs share_id"),
        (f"queue={QUEUE},share_id=a,priority=10000", [], "Batch takes 0 to 9999"),
        (f"queue={QUEUE},job_role_arn=dlrm-job", [], "job_role_arn='dlrm-job' is not an IAM role ARN"),
    ],
)
def test_bad_scheduler_input_is_refused_before_submission(cfg, component_args, fragment):
    result = torchx(
        "run", "--dryrun", "-s", "aws_batch", "-cfg", cfg, "--workspace", "", "components.dlrm:train", *component_args
    )
    assert result.returncode == 1
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_a_queue_that_is_not_there_is_said_in_one_line(aws):
    result = torchx("run", "-s", "aws_batch", "-cfg", "queue=missing-queue", "--workspace", "", "components.dlrm:train")
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert (
        "-s aws_batch: AWS Batch refused SubmitJob: Job queue missing-queue does not exist; check -cfg queue=" in out
    ), out
    assert "Traceback" not in out, out
