"""``-s slurm`` on Slurm 22.05 and later: TorchX's Slurm scheduler, reading ``squeue --json`` as
every one of those releases writes it.

TorchX's scheduler reads ``squeue --json -j ID`` as if it listed job ID only, each job with its
``job_resources``. Slurm 22.05 ignores ``-j`` with ``--json`` and lists the whole queue, so
``torchx status`` of one job reported another's state; it leaves ``job_resources`` out of jobs
that have not started, so ``torchx run`` and ``torchx status`` failed with KeyError while any job
in the queue was waiting (or had been cancelled while waiting); and it writes ``het_job_id`` as a
number, not an object, so ``torchx list`` on a cluster without accounting failed with TypeError.
Everything else is TorchX's: submission, ``sacct`` for finished jobs, logs, cancel, run options.
"""

import json
import subprocess
from typing import Any

from torchx.schedulers import slurm_scheduler
from torchx.schedulers.api import DescribeAppResponse, ListAppResponse
from torchx.schedulers.slurm_scheduler import get_appstate_from_job
from torchx.specs import AppState, ReplicaStatus, Role, RoleStatus


def het_job_id(job: dict[str, Any]) -> int:
    """The heterogeneous job that ``job`` is a component of; 0 if none.

    Slurm 22.05 writes a number (0 for none); later releases ``{"set": bool, "number": int}``.
    """
    value = job.get("het_job_id")
    if isinstance(value, dict):
        return value["number"] if value.get("set") else 0
    return value or 0


def jobs_of_app(jobs: list[dict[str, Any]], app_id: str) -> list[dict[str, Any]]:
    """The entries of ``squeue --json`` that make up app ``app_id``: the job itself or, for a
    multi-node app (a heterogeneous job), its components."""
    return [job for job in jobs if app_id in (str(job["job_id"]), str(het_job_id(job)))]


class SlurmScheduler(slurm_scheduler.SlurmScheduler):
    """TorchX's SlurmScheduler, with ``describe`` and ``list`` that work on Slurm 22.05+."""

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        # Raises CalledProcessError where squeue refuses a finished job's id; describe() then
        # asks sacct, as it does when this returns None.
        output = subprocess.check_output(
            ["squeue", "--json", "-j", app_id], stderr=subprocess.PIPE, encoding="utf-8"
        )
        jobs = jobs_of_app(json.loads(output)["jobs"], app_id)
        if not jobs:
            return None

        roles: dict[str, Role] = {}
        statuses: dict[str, RoleStatus] = {}
        state = AppState.UNKNOWN
        for job in jobs:
            # TorchX names each replica's job "{role}-{replica_id}"
            role_name, _, replica_id = job["name"].rpartition("-")
            if not role_name or not replica_id.isdigit():
                continue
            state = get_appstate_from_job(job)
            role = roles.setdefault(
                role_name,
                Role(
                    name=role_name,
                    image=job["current_working_directory"],
                    entrypoint=job["command"],
                    num_replicas=0,
                ),
            )
            status = statuses.setdefault(role_name, RoleStatus(role_name, replicas=[]))
            job_resources = job.get("job_resources")  # absent before a job starts, on 22.05
            if state == AppState.PENDING or not job_resources:
                hosts = [(self._squeue_pending_hostname(job, job_resources), None)]
            else:
                hosts = self._squeue_allocated_nodes(job_resources)
            for hostname, resource in hosts:
                if resource is not None:
                    role.resource = resource
                role.num_replicas += 1
                status.replicas.append(
                    ReplicaStatus(id=int(replica_id), role=role_name, state=state, hostname=hostname)
                )

        return DescribeAppResponse(
            app_id=app_id, roles=list(roles.values()), roles_statuses=list(statuses.values()), state=state
        )

    def _list_squeue(self) -> list[ListAppResponse]:
        output = subprocess.check_output(["squeue", "--json"], encoding="utf-8")
        return [
            ListAppResponse(app_id=str(job["job_id"]), state=get_appstate_from_job(job), name=job["name"])
            for job in json.loads(output)["jobs"]
            if het_job_id(job) in (0, job["job_id"])  # a multi-node app once, by its first component
        ]


def create_scheduler(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return SlurmScheduler(session_name=session_name, docker_client=kwargs.get("docker_client"))
