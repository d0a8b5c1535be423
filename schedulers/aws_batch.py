"""AWS Batch as a TorchX scheduler: every app runs as one multi-node parallel (MNP) job.

torchx-nightly dropped its AWS Batch scheduler; this one is registered as ``-s aws_batch``
through TorchX's plugin registry (``torchx_plugins/schedulers/dlrm_aws_batch.py``).

Each role of the app becomes a node range of the job (``targetNodes`` ``start:end``), node 0
is the main node, and the other nodes reach it through
``AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS`` (TorchX's ``rank0_env`` macro), which Batch
sets on every node but the main one; ``dist.torchrun`` falls back to ``localhost`` there.

The app handle is ``aws_batch://SESSION/QUEUE:JOB_NAME``: the job name is made unique at dry
run, so the handle is known before submission and is the ``TORCHX_JOB_ID`` the trainers see.
QUEUE is the queue's name, also where ``-cfg queue=`` gives the queue's ARN.

Prerequisites: a job queue whose compute environment runs on EC2 (Batch does not run MNP jobs
on Fargate or Spot), with the instance types you ask for (``-h``) and, for EFA, a cluster
placement group and a security group that lets the nodes reach each other on every port.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any, Iterator, Mapping

import boto3
import torchx
from botocore.exceptions import BotoCoreError, ClientError
from torchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    StructuredOpts,
)
from torchx.schedulers.devices import get_device_mounts
from torchx.schedulers.ids import make_unique
from torchx.specs import (
    AppDef,
    AppDryRunInfo,
    AppState,
    BindMount,
    CfgVal,
    DeviceMount,
    InvalidRunConfigException,
    ReplicaStatus,
    Resource,
    Role,
    RoleStatus,
    VolumeMount,
    is_terminal,
    macros,
    runopts,
)
from torchx.specs.finder import ComponentValidationException
from torchx.specs.named_resources_aws import EFA_DEVICE, K8S_ITYPE

from apps.core.common.errors import REFUSED
from apps.core.urls import AWS_CREDENTIALS_FIX, unreachable_aws_fix
from schedulers.combined_logs import CombinedLogs, LogRequest
from schedulers.docker_builds import DryRunWithoutDockerMixin
from schedulers.node_request import NodeRequestCheck
from schedulers.setup_checks import SetupError, first_line

#: Batch job status -> TorchX state. A terminated job ends FAILED, with the reason in ``msg``.
JOB_STATE: dict[str, AppState] = {
    "SUBMITTED": AppState.SUBMITTED,
    "PENDING": AppState.PENDING,
    "RUNNABLE": AppState.PENDING,
    "STARTING": AppState.PENDING,
    "RUNNING": AppState.RUNNING,
    "SUCCEEDED": AppState.SUCCEEDED,
    "FAILED": AppState.FAILED,
}

#: Tags on every job and job definition we create; ``list`` shows only jobs carrying the first.
TAG_TORCHX_VERSION = "torchx.pytorch.org/version"
TAG_APP_NAME = "torchx.pytorch.org/app-name"
TAG_USER = "torchx.pytorch.org/user"

#: Node ranges carry no name, so each container says which role it runs.
ENV_ROLE_NAME = "TORCHX_ROLE_NAME"

#: Batch limits (https://docs.aws.amazon.com/batch/latest/userguide/multi-node-parallel-jobs.html
#: and the RetryStrategy reference).
MAX_NODE_GROUPS = 5
MAX_ATTEMPTS = 10
MAX_PRIORITY = 9999

#: Where the awslogs driver of Batch containers writes unless a job definition says otherwise.
LOG_GROUP = "/aws/batch/job"
CANCEL_REASON = "cancelled with torchx cancel"

_JOB_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
#: Room for make_unique's "-" and random suffix within Batch's 128-character job names.
_MAX_NAME_STEM = 100
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$")
#: A job queue's name (CreateJobQueue: up to 128 letters, digits, - and _) or its ARN. Checked
#: because the queue's name is part of the app id, which TorchX writes into the trainers'
#: ``bash -c`` command line (``--rdzv_id``, ``${app_id}``).
_JOB_QUEUE = re.compile(r"(?:arn:aws[a-z-]*:batch:[a-z0-9-]+:\d{12}:job-queue/)?[A-Za-z0-9_-]{1,128}")
#: Names of environment variables that usually hold credentials: a job definition keeps its
#: environment in plain text, readable by anyone allowed to describe it.
_SECRET_ENV_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY|API_KEY", re.IGNORECASE)
_DEVICE_PERMISSIONS = {"r": "READ", "w": "WRITE", "m": "MKNOD"}
#: describe_jobs takes at most 100 job ids per call.
_DESCRIBE_BATCH = 100
_TAIL_POLL_SECONDS = 5.0

logger: logging.Logger = logging.getLogger(__name__)


class UnsupportedAppError(ComponentValidationException):
    """The app asks for something an AWS Batch multi-node job cannot run (raised at dry run)."""


@dataclass
class AWSBatchOpts(StructuredOpts):
    """Run options of ``-s aws_batch`` (``torchx runopts aws_batch``)."""

    queue: str
    """Job queue to submit to; its compute environment must run on EC2 (multi-node jobs)."""

    user: str = getpass.getuser()
    """User the job is tagged with (torchx.pytorch.org/user)."""

    share_id: str | None = None
    """Share identifier: required by, and only accepted on, queues with a fair-share policy."""

    priority: int | None = None
    """Scheduling priority within the share, 0-9999 (higher runs first); needs share_id."""

    job_role_arn: str | None = None
    """IAM role the containers assume for AWS access (e.g. reading the data set from S3)."""

    execution_role_arn: str | None = None
    """IAM role the ECS agent assumes (e.g. to pull the image from a private ECR)."""

    shm_size: int | None = None
    """Size of /dev/shm in MiB (data loader workers share batches through it); default: the node's memory."""


@dataclass
class BatchJobRequest:
    """The two Batch API calls a submission makes, as their keyword arguments."""

    job_definition: dict[str, Any]
    """``batch.register_job_definition(**job_definition)``"""

    job: dict[str, Any]
    """``batch.submit_job(**job)``, with ``jobDefinition`` pinned to the registered revision."""

    images_to_push: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def app_id(self) -> str:
        return _app_id(self.job["jobQueue"], self.job["jobName"])

    def __str__(self) -> str:
        return json.dumps({"registerJobDefinition": self.job_definition, "submitJob": self.job}, indent=2)


class AWSBatchScheduler(NodeRequestCheck, CombinedLogs, DryRunWithoutDockerMixin, Scheduler[AWSBatchOpts]):
    """Runs TorchX apps as AWS Batch multi-node parallel jobs.

    Credentials, region and endpoint come from boto3's usual sources (``AWS_PROFILE``,
    ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``, instance roles, ...); a submission without a region
    or credentials is refused in one line before anything is pushed or registered.

    Mounts: ``type=bind,src=HOST_PATH,dst=PATH[,readonly]`` (host volume),
    ``type=volume,src=fs-ID,dst=PATH[,readonly]`` (EFS file system),
    ``type=device,src=/dev/X[,dst=PATH][,perm=rwm]``. A named resource with EFA interfaces
    (e.g. ``-h aws_p4d.24xlarge``) gets its ``/dev/infiniband/uverbs*`` devices mounted.
    Logs: ``torchx log`` reads each node's CloudWatch Logs stream (stdout and stderr together).
    """

    def __init__(self, session_name: str) -> None:
        super().__init__("aws_batch", session_name)

    # Checked before either client is made: status, logs, list and cancel on a machine without
    # the AWS setup say what is missing in one line too (schedulers/cli.py prints it).
    @cached_property
    def _batch(self) -> Any:
        check_aws_setup()
        return boto3.client("batch")

    @cached_property
    def _logs(self) -> Any:
        check_aws_setup()
        return boto3.client("logs")

    def _run_opts(self) -> runopts:
        return AWSBatchOpts.as_runopts()

    # ── submission ───────────────────────────────────────────────────────────────────────

    def _submit_dryrun(self, app: AppDef, cfg: AWSBatchOpts) -> AppDryRunInfo[BatchJobRequest, AWSBatchOpts]:
        _check_opts(cfg)
        _check_app(app)
        _warn_of_credentials(app)
        name = make_unique(_JOB_NAME_CHARS.sub("-", app.name).strip("-_")[:_MAX_NAME_STEM] or "torchx")
        app_id = _app_id(cfg.queue, name)
        images_to_push = self.dryrun_push_images(app, cfg)

        node_ranges = []
        first_node = 0
        for role in app.roles:
            node_ranges.append(_node_range(role, first_node, app_id, cfg))
            first_node += role.num_replicas

        tags = {TAG_TORCHX_VERSION: torchx.__version__, TAG_APP_NAME: app.name, TAG_USER: cfg.user}
        job_definition = {
            "jobDefinitionName": name,
            "type": "multinode",
            "nodeProperties": {"numNodes": first_node, "mainNode": 0, "nodeRangeProperties": node_ranges},
            "retryStrategy": _retry_strategy(max(role.max_retries for role in app.roles)),
            "propagateTags": True,
            "tags": tags,
        }
        job: dict[str, Any] = {"jobName": name, "jobQueue": cfg.queue, "jobDefinition": name, "tags": tags}
        if cfg.share_id is not None:
            job["shareIdentifier"] = cfg.share_id
        if cfg.priority is not None:
            job["schedulingPriorityOverride"] = cfg.priority
        return AppDryRunInfo(BatchJobRequest(job_definition, job, images_to_push), str)

    def schedule(self, dryrun_info: AppDryRunInfo[BatchJobRequest, AWSBatchOpts]) -> str:
        self.refuse_unbuilt_workspaces(dryrun_info.app)
        check_aws_setup()  # before an image is pushed
        request = dryrun_info.request
        self.push_images(request.images_to_push)
        with _reaching_batch():
            registered = self._batch.register_job_definition(**request.job_definition)
            self._batch.submit_job(**{**request.job, "jobDefinition": registered["jobDefinitionArn"]})
        return request.app_id

    # ── status ───────────────────────────────────────────────────────────────────────────

    def _job_summaries(self, queue: str, job_filter: dict[str, Any]) -> list[dict[str, Any]]:
        # Without a filter list_jobs returns RUNNING jobs only; with one, jobs in every status.
        pages = self._batch.get_paginator("list_jobs").paginate(jobQueue=queue, filters=[job_filter])
        return [summary for page in pages for summary in page["jobSummaryList"]]

    def _describe_jobs(self, job_ids: list[str]) -> list[dict[str, Any]]:
        """``describe_jobs`` of any number of jobs (Batch takes 100 per call); unknown ids are left out."""
        return [
            job
            for start in range(0, len(job_ids), _DESCRIBE_BATCH)
            for job in self._batch.describe_jobs(jobs=job_ids[start : start + _DESCRIBE_BATCH])["jobs"]
        ]

    def _find_job(self, app_id: str) -> dict[str, Any] | None:
        """The newest job of the app's queue with the app's (unique) job name."""
        queue, name = _parse_app_id(app_id)
        summaries = self._job_summaries(queue, {"name": "JOB_NAME", "values": [name]})
        if not summaries:
            return None
        newest = max(summaries, key=lambda summary: summary["createdAt"])
        described = self._describe_jobs([newest["jobId"]])
        return described[0] if described else None

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        job = self._find_job(app_id)
        if job is None:
            return None
        state = JOB_STATE[job["status"]]
        # Batch reports each started node as a child job "<jobId>#<node index>"; nodes it does
        # not report (not started yet) are in the state of the job as a whole.
        node_ids = [f"{job['jobId']}#{node}" for node in range(job["nodeProperties"]["numNodes"])]
        node_states = {
            node["nodeDetails"]["nodeIndex"]: JOB_STATE[node["status"]] for node in self._describe_jobs(node_ids)
        }
        roles, statuses = [], []
        for first, last, container in _node_ranges(job):
            role = _role_from_container(container, num_replicas=last - first + 1)
            roles.append(role)
            statuses.append(
                RoleStatus(
                    role.name,
                    [
                        ReplicaStatus(id=node - first, state=node_states.get(node, state), role=role.name, hostname="")
                        for node in range(first, last + 1)
                    ],
                )
            )
        return DescribeAppResponse(
            app_id=app_id,
            state=state,
            num_restarts=max(len(job.get("attempts", [])) - 1, 0),
            msg=job.get("statusReason", ""),
            ui_url=_console_url(job["jobArn"]),
            roles=roles,
            roles_statuses=statuses,
        )

    def list(self, cfg: Mapping[str, CfgVal] | None = None) -> list[ListAppResponse]:
        """The TorchX jobs of ``cfg["queue"]``, or of every queue when no queue is given."""
        queue = (cfg or {}).get("queue")
        queues = (
            [str(queue)]
            if queue
            else [
                q["jobQueueName"]
                for page in self._batch.get_paginator("describe_job_queues").paginate()
                for q in page["jobQueues"]
            ]
        )
        return [app for name in queues for app in self._list_queue(name)]

    def _list_queue(self, queue: str) -> builtins.list[ListAppResponse]:  # in the class, list is the method
        summaries = self._job_summaries(queue, {"name": "AFTER_CREATED_AT", "values": ["0"]})
        return [
            ListAppResponse(
                app_id=_app_id(queue, job["jobName"]),
                state=JOB_STATE[job["status"]],
                name=job["tags"].get(TAG_APP_NAME, job["jobName"]),
            )
            for job in self._describe_jobs([summary["jobId"] for summary in summaries])
            # list_jobs cannot filter by tag.
            if TAG_TORCHX_VERSION in job.get("tags", {})
        ]

    def _cancel_existing(self, app_id: str) -> None:
        job = self._find_job(app_id)
        if job is not None:
            # Batch ignores this for a job that already finished.
            self._batch.terminate_job(jobId=job["jobId"], reason=CANCEL_REASON)

    # ── logs ─────────────────────────────────────────────────────────────────────────────

    ONE_STREAM = "aws_batch has one log stream per node (stdout and stderr together)"

    def _replica_log(self, asked: LogRequest) -> Iterator[str]:
        job = self._find_job(asked.app_id)
        if job is None:
            raise ValueError(f"no AWS Batch job for app `{asked.app_id}`")
        return self._log_lines(asked, job, _node_index(job, asked.role_name, asked.k))

    def _log_lines(self, asked: LogRequest, job: dict[str, Any], node: int) -> Iterator[str]:
        query: dict[str, Any] = {"logGroupName": LOG_GROUP, "startFromHead": True}
        if asked.since is not None:
            query["startTime"] = _millis(asked.since)
        if asked.until is not None:
            query["endTime"] = _millis(asked.until)
        while True:
            # Decided before reading, so that the read after the job ended sees every line.
            ended = not asked.should_tail or is_terminal(JOB_STATE[job["status"]])
            stream = query.get("logStreamName") or self._log_stream(job, node)
            page = self._log_page({**query, "logStreamName": stream}) if stream else None
            if page is not None:
                query["logStreamName"] = stream
                for event in page["events"]:
                    yield event["message"] + "\n"
                # The stream's end returns the token it was given.
                if page["nextForwardToken"] != query.get("nextToken"):
                    query["nextToken"] = page["nextForwardToken"]
                    continue
            if ended:
                return
            time.sleep(_TAIL_POLL_SECONDS)
            job = self._find_job(asked.app_id) or job

    def _log_page(self, query: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self._logs.get_log_events(**query)
        except self._logs.exceptions.ResourceNotFoundException:
            return None  # the node has not written its first line yet

    def _log_stream(self, job: dict[str, Any], node: int) -> str | None:
        """The CloudWatch Logs stream of the node's latest attempt, once it has one."""
        described = self._describe_jobs([f"{job['jobId']}#{node}"])
        if not described and node == job["nodeProperties"]["mainNode"]:
            # A Batch that reports the job as a whole, without child jobs per node (moto's
            # does), gives the main node's stream on the job itself.
            described = [job]
        for source in described:
            containers = [source.get("container") or {}]
            containers += [attempt.get("container") or {} for attempt in reversed(source.get("attempts") or [])]
            for container in containers:
                if container.get("logStreamName"):
                    return container["logStreamName"]
        return None


# ── the submitting machine ───────────────────────────────────────────────────────────────


def _retry_strategy(max_retries: int) -> dict[str, Any]:
    """Batch's retries of a job: ``max_retries`` (Batch counts attempts, TorchX retries), except
    after a refusal (exit REFUSED: a bad option or input, which every attempt would meet again).
    Batch retries an attempt that no ``evaluateOnExit`` condition matches."""
    strategy: dict[str, Any] = {"attempts": max_retries + 1}
    if max_retries:
        strategy["evaluateOnExit"] = [{"onExitCode": str(REFUSED), "action": "EXIT"}]
    return strategy


def check_aws_setup() -> None:
    """Refuses, in one line, a machine that boto3 cannot submit from: a profile or credentials it
    cannot read, no region, or no credentials. A dry run needs none of them."""
    try:
        session = boto3.Session()
        credentials = session.get_credentials()
    except BotoCoreError as e:  # AWS_PROFILE naming no profile, half of a key pair, ...
        raise SetupError(
            f"-s aws_batch cannot read the AWS configuration ({first_line(e)}): fix AWS_PROFILE, the AWS_* "
            "variables or ~/.aws/config, or run `aws configure`"
        ) from None
    if not session.region_name:
        raise SetupError(f"-s aws_batch has no AWS region to submit to: {_region_fix()}")
    if credentials is None:
        raise SetupError(f"-s aws_batch found no AWS credentials: {AWS_CREDENTIALS_FIX}")


def _region_fix() -> str:
    # boto3 reads AWS_DEFAULT_REGION; AWS_REGION, which other AWS tools read, it ignores.
    ignored = os.environ.get("AWS_REGION")
    if ignored:
        return f"boto3 does not read AWS_REGION={ignored}: set AWS_DEFAULT_REGION={ignored}"
    return "set AWS_DEFAULT_REGION (e.g. AWS_DEFAULT_REGION=us-west-2), or run `aws configure`"


@contextlib.contextmanager
def _reaching_batch() -> Iterator[None]:
    """An endpoint that refuses the connection, credentials that vanish, or a request that AWS
    Batch refuses (a queue that is not there, a role it may not use), as one line."""
    try:
        yield
    except BotoCoreError as e:
        fix = unreachable_aws_fix(e)
        if fix is None:
            raise
        raise SetupError(f"-s aws_batch cannot reach AWS Batch: {fix}") from None
    except ClientError as e:
        error = e.response.get("Error", {})
        said = " ".join(str(error.get("Message") or error.get("Code") or first_line(e)).split())
        raise SetupError(
            f"-s aws_batch: AWS Batch refused {e.operation_name}: {said}; check -cfg queue= (`aws batch "
            "describe-job-queues` lists this account's queues in this region) and the job's roles"
        ) from None


# ── request rendering ────────────────────────────────────────────────────────────────────


def _check_opts(cfg: AWSBatchOpts) -> None:
    if not _JOB_QUEUE.fullmatch(cfg.queue):
        raise InvalidRunConfigException(
            f"queue={cfg.queue!r} is neither a job queue name (1 to 128 letters, digits, - and _) nor a "
            "job queue ARN (arn:aws:batch:REGION:ACCOUNT:job-queue/NAME)",
            "queue",
            cfg,
        )
    if cfg.priority is not None:
        if not 0 <= cfg.priority <= MAX_PRIORITY:
            raise InvalidRunConfigException(
                f"priority={cfg.priority} is out of range: Batch takes 0 to {MAX_PRIORITY}", "priority", cfg
            )
        if cfg.share_id is None:
            raise InvalidRunConfigException(
                f"priority={cfg.priority} needs share_id: priorities apply within a share of a fair-share queue",
                "priority",
                cfg,
            )
    for key in ("job_role_arn", "execution_role_arn"):
        arn = getattr(cfg, key)
        if arn is not None and not _ROLE_ARN.match(arn):
            raise InvalidRunConfigException(
                f"{key}={arn!r} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)", key, cfg
            )
    if cfg.shm_size is not None and cfg.shm_size <= 0:
        raise InvalidRunConfigException(f"shm_size={cfg.shm_size} must be a positive number of MiB", "shm_size", cfg)


def _check_app(app: AppDef) -> None:
    if len(app.roles) > MAX_NODE_GROUPS:
        raise UnsupportedAppError(
            f"app `{app.name}` has {len(app.roles)} roles; an AWS Batch multi-node job has at most "
            f"{MAX_NODE_GROUPS} node groups"
        )
    for role in app.roles:
        if role.min_replicas is not None and role.min_replicas < role.num_replicas:
            raise UnsupportedAppError(
                f"role `{role.name}` is elastic ({role.min_replicas} to {role.num_replicas} nodes), but an "
                f"AWS Batch multi-node job has a fixed node count: use -j {role.num_replicas}xNPROC"
            )
        if role.max_retries >= MAX_ATTEMPTS:
            raise UnsupportedAppError(
                f"role `{role.name}` asks for max_retries={role.max_retries}; AWS Batch allows at most "
                f"{MAX_ATTEMPTS - 1} retries ({MAX_ATTEMPTS} attempts)"
            )
    instance_types = {role.resource.capabilities.get(K8S_ITYPE) for role in app.roles} - {None}
    if len(instance_types) > 1:
        raise UnsupportedAppError(
            f"roles ask for different instance types {sorted(instance_types)}; all node groups of an "
            "AWS Batch multi-node job run on one instance type"
        )


def _warn_of_credentials(app: AppDef) -> None:
    """Warns, naming them but not their values, of environment variables that look like credentials."""
    names = sorted({name for role in app.roles for name in role.env if _SECRET_ENV_NAME.search(name)})
    if names:
        logger.warning(
            "environment variables %s look like credentials, which the Batch job definition keeps in plain "
            "text for anyone allowed to describe it: give the job an IAM role instead "
            "(-cfg job_role_arn=arn:aws:iam::ACCOUNT:role/NAME)",
            ", ".join(names),
        )


def _node_range(role: Role, first_node: int, app_id: str, cfg: AWSBatchOpts) -> dict[str, Any]:
    node_index = "$AWS_BATCH_JOB_NODE_INDEX"
    role = macros.Values(
        img_root="",
        app_id=app_id,
        # Shell syntax: resolved where the entrypoint is a shell (dist.torchrun runs bash -c).
        replica_id=f"$(({node_index[1:]} - {first_node}))" if first_node else node_index,
        rank0_env="AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS",
    ).apply(role)
    resource = role.resource

    volumes, mount_points, devices = [], [], []
    for i, mount in enumerate([*role.mounts, *get_device_mounts(resource.devices)]):
        if isinstance(mount, DeviceMount):
            devices.append(
                {
                    "hostPath": mount.src_path,
                    "containerPath": mount.dst_path,
                    "permissions": [_DEVICE_PERMISSIONS[p] for p in mount.permissions],
                }
            )
            continue
        volume = f"mount{i}"
        if isinstance(mount, BindMount):
            volumes.append({"name": volume, "host": {"sourcePath": mount.src_path}})
        elif isinstance(mount, VolumeMount):
            volumes.append({"name": volume, "efsVolumeConfiguration": {"fileSystemId": mount.src}})
        mount_points.append({"sourceVolume": volume, "containerPath": mount.dst_path, "readOnly": mount.read_only})

    container: dict[str, Any] = {
        "image": role.image,
        "command": [role.entrypoint, *role.args],
        "environment": [{"name": k, "value": v} for k, v in {**role.env, ENV_ROLE_NAME: role.name}.items()],
        "resourceRequirements": _resource_requirements(resource),
        "linuxParameters": {"sharedMemorySize": cfg.shm_size or resource.memMB, "devices": devices},
        "volumes": volumes,
        "mountPoints": mount_points,
        "logConfiguration": {"logDriver": "awslogs"},
    }
    if resource.devices.get(EFA_DEVICE):
        # libfabric pins the buffers it registers with the EFA device.
        container["ulimits"] = [{"name": "memlock", "softLimit": -1, "hardLimit": -1}]
    if K8S_ITYPE in resource.capabilities:
        container["instanceType"] = resource.capabilities[K8S_ITYPE]
    if cfg.job_role_arn:
        container["jobRoleArn"] = cfg.job_role_arn
    if cfg.execution_role_arn:
        container["executionRoleArn"] = cfg.execution_role_arn
    last_node = first_node + role.num_replicas - 1
    return {"targetNodes": f"{first_node}:{last_node}", "container": container}


def _resource_requirements(resource: Resource) -> list[dict[str, str]]:
    requirements = [
        {"type": "VCPU", "value": str(max(resource.cpu, 1))},
        {"type": "MEMORY", "value": str(resource.memMB)},
    ]
    if resource.gpu > 0:
        requirements.append({"type": "GPU", "value": str(resource.gpu)})
    return requirements


# ── reading jobs back ────────────────────────────────────────────────────────────────────


def _app_id(queue: str, job_name: str) -> str:
    """``QUEUE_NAME:JOB_NAME`` of a job submitted to ``queue`` (a name or an ARN).

    The name, not the ARN: an ARN's ``/`` would split TorchX's app handle
    (``SCHEDULER://SESSION/APP_ID``) and its ``:`` this app id. Batch's calls take either.
    """
    return f"{queue.rpartition('/')[2]}:{job_name}"


def _parse_app_id(app_id: str) -> tuple[str, str]:
    queue, sep, name = app_id.partition(":")
    if not (sep and queue and name):
        raise ValueError(f"`{app_id}` is not an aws_batch app id: expected QUEUE:JOB_NAME")
    return queue, name


def _node_ranges(job: dict[str, Any]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(first node, last node, container) of each node range; ``targetNodes`` may omit either end."""
    properties = job["nodeProperties"]
    for node_range in properties["nodeRangeProperties"]:
        first, sep, last = node_range["targetNodes"].partition(":")
        first_node = int(first or 0)
        last_node = int(last or properties["numNodes"] - 1) if sep else first_node
        yield first_node, last_node, node_range["container"]


def _role_from_container(container: dict[str, Any], num_replicas: int) -> Role:
    env = {item["name"]: item["value"] for item in container.get("environment", [])}
    requirements = {item["type"]: int(item["value"]) for item in container.get("resourceRequirements", [])}
    command = container.get("command") or [""]
    return Role(
        name=env.get(ENV_ROLE_NAME, "node"),
        image=container.get("image", ""),
        entrypoint=command[0],
        args=command[1:],
        env=env,
        num_replicas=num_replicas,
        resource=Resource(
            cpu=requirements.get("VCPU", 0),
            gpu=requirements.get("GPU", 0),
            memMB=requirements.get("MEMORY", 0),
            capabilities={K8S_ITYPE: container["instanceType"]} if "instanceType" in container else {},
        ),
    )


def _node_index(job: dict[str, Any], role_name: str, k: int) -> int:
    roles = []
    for first, last, container in _node_ranges(job):
        role = _role_from_container(container, num_replicas=last - first + 1)
        if role.name == role_name:
            if not 0 <= k < role.num_replicas:
                raise ValueError(
                    f"role `{role_name}` of job {job['jobName']} has replicas 0 to {role.num_replicas - 1}, not {k}"
                )
            return first + k
        roles.append(role.name)
    raise ValueError(f"job {job['jobName']} has no role `{role_name}`; its roles: {', '.join(roles)}")


def _console_url(job_arn: str) -> str | None:
    match = re.match(r"arn:aws:batch:([a-z0-9-]+):\d+:job/([a-z0-9-]+)$", job_arn)
    if match is None:
        return None
    region, job_id = match.groups()
    return f"https://{region}.console.aws.amazon.com/batch/home?region={region}#jobs/mnp-job/{job_id}"


def _millis(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)
