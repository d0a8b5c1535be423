"""``-s slurm`` on Slurm 22.05 and later: TorchX's Slurm scheduler, reading ``squeue --json`` as
every one of those releases writes it.

TorchX's scheduler reads ``squeue --json -j ID`` as if it listed job ID only, each job with its
``job_resources``. Slurm 22.05 ignores ``-j`` with ``--json`` and lists the whole queue, so
``torchx status`` of one job reported another's state; it leaves ``job_resources`` out of jobs
that have not started, so ``torchx run`` and ``torchx status`` failed with KeyError while any job
in the queue was waiting (or had been cancelled while waiting); and it writes ``het_job_id`` as a
number, not an object, so ``torchx list`` on a cluster without accounting failed with TypeError.

A job that its launchers refused (exit 2: a bad option or input, which every retry would meet
again) is not requeued, whatever retries are left.

A role whose metadata names its run's folder (``LOG_DIR``: components.dlrm:train's --output_dir)
has its logs written there, ``slurm-<id>-<role>-<n>.out`` and ``.err``, and so has the script
itself (``slurm-<id>.out``): nothing lands in the directory the job was submitted from, and
``torchx log`` reads them there.

Without sbatch on PATH, a submission is refused in one line before anything is written (the
script, or the workspace copied into ``job_dir``); a dry run needs no Slurm and still prints the
script.

And no value can rewrite the sbatch script: run options that TorchX writes into it are checked
before anything is built or submitted, and each replica's environment is set by quoted
``env -- NAME=VALUE ...`` arguments instead of srun's comma-separated ``--export`` list.

Everything else is TorchX's: submission, ``sacct`` for finished jobs, logs, cancel, run options.
"""

import builtins
import dataclasses
import json
import os
import re
import shlex
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
    macros,
)
from torchx.specs.finder import ComponentValidationException

from apps.core.common.errors import REFUSED
from schedulers.metadata import LOG_DIR
from schedulers.node_request import NodeRequestCheck
from schedulers.setup_checks import require_command

#: Run options that TorchX writes on the script's ``#SBATCH`` lines, space-separated and
#: unquoted: a newline there starts shell code, and a space, quote, backslash or ``#`` changes the
#: options sbatch reads. Their values (partition lists, times, constraint expressions, QOS
#: names) need none of these, so they are held to the characters below rather than quoted.
SBATCH_LINE_OPTIONS = ("partition", "time", "constraint", "qos")
SBATCH_LINE_CHARACTERS = "letters, digits and _ . , : - * & | ! [ ] ( ) + = @ /"
_SBATCH_LINE_VALUE = re.compile(r"[A-Za-z0-9_.,:*&|!()\[\]+=@/-]+")


#: What a machine without Slurm's client commands needs to submit.
SBATCH_FIX = "run torchx on a Slurm login node, or install Slurm's client commands (Debian: slurm-client)"


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


#: TorchX's sbatch script requeues a failed job while retries are left (its exit status is the
#: highest of srun's tasks, the launchers' on every node); ours not after a refusal.
_REQUEUE_TEST = '    if [ "$TORCHX_MAX_RETRIES" -gt "${SLURM_RESTART_COUNT:-0}" ]; then\n'


@dataclasses.dataclass(repr=False)  # TorchX's repr: the command and the script
class BatchRequest(SlurmBatchRequest):
    """TorchX's batch request, whose script first makes ``log_dir`` (its replicas' logs go there;
    none where empty) and moves its own output, ``slurm-<id>.out``, into it, and does not requeue
    a job its launchers refused (exit REFUSED: a configuration error fails again on every retry)."""

    log_dir: str = ""

    def materialize(self) -> str:
        script = super().materialize()
        anchor = "\nset +e\nsrun "
        for expected in (anchor, _REQUEUE_TEST):
            if expected not in script:
                raise AssertionError(f"TorchX's sbatch script no longer has {expected!r}:\n{script}")
        refused = f"# {REFUSED}: the job was refused (a configuration error), which a requeued job would be too.\n"
        script = script.replace(
            _REQUEUE_TEST,
            "    " + refused + _REQUEUE_TEST.replace("; then", f" && [ $exitcode -ne {REFUSED} ]; then"),
            1,
        )
        if not self.log_dir:
            return script
        folder = '"$SLURM_JOB_ID"'.join(shlex.quote(part) if part else "" for part in self.log_dir.split(macros.app_id))
        batch_log = 'slurm-"$SLURM_JOB_ID".out'
        prelude = (
            f"\n# The run's folder: the logs go there, this script's own too (sbatch's default, {batch_log}).\n"
            f"mkdir -p -- {folder}\n"
            f"if [ -e {batch_log} ]; then mv -n -- {batch_log} {folder}/ || true; fi\n"
        )
        return script.replace(anchor, prelude + anchor, 1)


def batch_request(request: SlurmBatchRequest, app: AppDef) -> BatchRequest:
    """``request`` as ours (:class:`BatchRequest`), with the logs of each role whose metadata
    names a LOG_DIR in that folder."""
    log_dirs = {role.name: role.metadata[LOG_DIR] for role in app.roles if role.metadata.get(LOG_DIR)}
    for name, replica in request.replicas.items():
        log_dir = log_dirs.get(name.rpartition("-")[0])  # TorchX names a replica "{role}-{replica_id}"
        if log_dir:
            for stream in ("output", "error"):
                # srun reads % in a file name as a pattern (%j); %% is a plain %.
                replica.srun_opts[stream] = os.path.join(log_dir, replica.srun_opts[stream]).replace("%", "%%")
    fields = {field.name: getattr(request, field.name) for field in dataclasses.fields(request)}
    return BatchRequest(**fields, log_dir=next(iter(log_dirs.values()), ""))


class SlurmScheduler(NodeRequestCheck, slurm_scheduler.SlurmScheduler):
    """TorchX's SlurmScheduler, with ``describe`` and ``list`` that work on Slurm 22.05+, and an
    sbatch script whose text no run option or environment value can change."""

    def _pre_build_validate(self, app: AppDef, scheduler: str, cfg: Mapping[str, CfgVal]) -> None:
        # Before the workspace is built: the `dir` builder copies it into a job_dir that must not
        # exist yet, so a refusal after the copy would also refuse the corrected command.
        super()._pre_build_validate(app, scheduler, cfg)
        check_script_text(app, cfg)
        if cfg.get("job_dir"):  # the `dir` builder copies into it at dry run: a left copy refuses the rerun
            require_command("sbatch", "slurm", SBATCH_FIX)

    def _submit_dryrun(self, app: AppDef, cfg: SlurmOpts) -> AppDryRunInfo[SlurmBatchRequest, SlurmOpts]:
        dryrun_info = super()._submit_dryrun(app, cfg)
        for replica in dryrun_info.request.replicas.values():
            set_env_by_command(replica)
        dryrun_info.request = batch_request(dryrun_info.request, app)
        return dryrun_info

    def schedule(self, dryrun_info: AppDryRunInfo[SlurmBatchRequest, SlurmOpts]) -> str:
        require_command("sbatch", "slurm", SBATCH_FIX)  # before TorchX writes the script
        job_id = super().schedule(dryrun_info)
        request = dryrun_info.request
        if isinstance(request, BatchRequest) and request.log_dir:
            # Where `torchx log` looks for the job's logs (TorchX's record, the last entry wins).
            log_dir = request.log_dir.replace(macros.app_id, job_id)
            slurm_scheduler._save_job_dir(job_id, os.path.abspath(os.path.join(request.job_dir or "", log_dir)))
        return job_id

    # Without Slurm's commands (not a login node) status, list and cancel say so in one line
    # (schedulers/cli.py prints it), where TorchX's raised FileNotFoundError.
    def describe(self, app_id: str) -> DescribeAppResponse | None:
        require_command("squeue", "slurm", SBATCH_FIX, "reads jobs' states")
        return super().describe(app_id)

    def list(self, cfg: Mapping[str, CfgVal] | None = None) -> list[ListAppResponse]:
        require_command("squeue", "slurm", SBATCH_FIX, "lists jobs")
        return super().list(cfg)

    def _cancel_existing(self, app_id: str) -> None:
        require_command("scancel", "slurm", SBATCH_FIX, "cancels jobs")
        super()._cancel_existing(app_id)

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

    def _list_squeue(self) -> builtins.list[ListAppResponse]:  # in the class, list is the method
        output = subprocess.check_output(["squeue", "--json"], encoding="utf-8")
        return [
            ListAppResponse(app_id=str(job["job_id"]), state=get_appstate_from_job(job), name=job["name"])
            for job in json.loads(output)["jobs"]
            if het_job_id(job) in (0, job["job_id"])  # a multi-node app once, by its first component
        ]


def create_scheduler(session_name: str, **kwargs: Any) -> SlurmScheduler:
    return SlurmScheduler(session_name=session_name, docker_client=kwargs.get("docker_client"))
