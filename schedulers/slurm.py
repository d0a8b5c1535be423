"""``-s slurm`` on Slurm 22.05 and later: TorchX's Slurm scheduler, reading ``squeue --json`` as
every one of those releases writes it.

TorchX's scheduler reads ``squeue --json -j ID`` as if it listed job ID only, each job with its
``job_resources``. Slurm 22.05 ignores ``-j`` with ``--json`` and lists the whole queue, so
``torchx status`` of one job reported another's state; it leaves ``job_resources`` out of jobs
that have not started, so ``torchx run`` and ``torchx status`` failed with KeyError while any job
in the queue was waiting (or had been cancelled while waiting); and it writes ``het_job_id`` as a
number, not an object, so ``torchx list`` on a cluster without accounting failed with TypeError.

And no value can rewrite the sbatch script: run options that TorchX writes into it are checked
before anything is built or submitted, and each replica's environment is set by quoted
``env -- NAME=VALUE ...`` arguments instead of srun's comma-separated ``--export`` list.

Everything else is TorchX's: submission, ``sacct`` for finished jobs, logs, cancel, run options.
"""

import json
import re
import subprocess
from typing import Any, Mapping

from torchx.schedulers import slurm_scheduler
from torchx.schedulers.api import DescribeAppResponse, ListAppResponse
from torchx.schedulers.slurm_scheduler import SlurmBatchRequest, SlurmOpts, SlurmReplicaRequest, get_appstate_from_job
from torchx.specs import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    InvalidRunConfigException,
    ReplicaStatus,
    Role,
    RoleStatus,
)
from torchx.specs.finder import ComponentValidationException

#: Run options that TorchX writes on the script's ``#SBATCH`` lines, space-separated and
#: unquoted: a newline there starts shell code, and a space, quote, backslash or ``#`` changes the
#: options sbatch reads. Their values (partition lists, times, constraint expressions, QOS
#: names) need none of these, so they are held to the characters below rather than quoted.
SBATCH_LINE_OPTIONS = ("partition", "time", "constraint", "qos")
SBATCH_LINE_CHARACTERS = "letters, digits and _ . , : - * & | ! [ ] ( ) + = @ /"
_SBATCH_LINE_VALUE = re.compile(r"[A-Za-z0-9_.,:*&|!()\[\]+=@/-]+")


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


def check_script_text(app: AppDef, cfg: Mapping[str, CfgVal]) -> None:
    """Refuses run options and role names that would change the sbatch script's text.

    Options on ``#SBATCH`` lines (and role names, which become ``--job-name``) take only
    SBATCH_LINE_CHARACTERS; the other text options take printable characters: the script echoes
    them in a comment (``# Run with: sbatch ...``) that a newline would end.
    """
    for key, value in cfg.items():
        if key in SBATCH_LINE_OPTIONS and value is not None and not _SBATCH_LINE_VALUE.fullmatch(str(value)):
            raise InvalidRunConfigException(
                f"{key}={value!r} would change the sbatch script's #SBATCH line: {key} takes "
                f"{SBATCH_LINE_CHARACTERS} only",
                key,
                cfg,
            )
        if isinstance(value, str) and not value.isprintable():
            raise InvalidRunConfigException(
                f"{key}={value!r} has a control character (newline, tab, ...) that would change the "
                "sbatch script: use printable characters only",
                key,
                cfg,
            )
    for role in app.roles:
        if not _SBATCH_LINE_VALUE.fullmatch(role.name):
            raise ComponentValidationException(
                f"role name {role.name!r} would change the sbatch script's #SBATCH --job-name: "
                f"a role name takes {SBATCH_LINE_CHARACTERS} only"
            )


def set_env_by_command(replica: SlurmReplicaRequest) -> None:
    """Runs the replica's command under ``env -- NAME=VALUE ...`` instead of exporting its
    environment with srun's ``--export=ALL,NAME=VALUE,...``.

    srun splits that list at every comma, values included: ``--env NCCL_SOCKET_IFNAME=eth0,eth1``
    reached the trainers as ``eth0``, and a value ``run,LD_PRELOAD=/tmp/x.so`` set a variable of
    its own. ``env``'s arguments are quoted like the command's, so every value arrives whole.
    """
    assignments = [f"{name}={value}" for name, value in replica.env.items()]
    replica.args = ["--", *assignments, replica.entrypoint, *replica.args]
    replica.entrypoint = "env"
    replica.env = {}
    # As TorchX's --export=ALL,...: the job's own environment, with these values over it.
    replica.srun_opts["export"] = "ALL"


class SlurmScheduler(slurm_scheduler.SlurmScheduler):
    """TorchX's SlurmScheduler, with ``describe`` and ``list`` that work on Slurm 22.05+, and an
    sbatch script whose text no run option or environment value can change."""

    def _pre_build_validate(self, app: AppDef, scheduler: str, cfg: Mapping[str, CfgVal]) -> None:
        # Before the workspace is built: the `dir` builder copies it into a job_dir that must not
        # exist yet, so a refusal after the copy would also refuse the corrected command.
        super()._pre_build_validate(app, scheduler, cfg)
        check_script_text(app, cfg)

    def _submit_dryrun(self, app: AppDef, cfg: SlurmOpts) -> AppDryRunInfo[SlurmBatchRequest, SlurmOpts]:
        dryrun_info = super()._submit_dryrun(app, cfg)
        for replica in dryrun_info.request.replicas.values():
            set_env_by_command(replica)
        return dryrun_info

    def _describe_squeue(self, app_id: str) -> DescribeAppResponse | None:
        # Raises CalledProcessError where squeue refuses a finished job's id; describe() then
        # asks sacct, as it does when this returns None.
        output = subprocess.check_output(["squeue", "--json", "-j", app_id], stderr=subprocess.PIPE, encoding="utf-8")
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
