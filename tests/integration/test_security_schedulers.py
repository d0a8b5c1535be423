"""Hostile and sloppy input to our schedulers (``-s aws_batch``, ``-s slurm``), through
``torchx run --dryrun`` as a user gives it: run options and environment values must not become
shell or sbatch text of their own, and credentials passed as environment values are pointed out.
"""

import itertools
import os
import subprocess

import pytest
from torchx import specs
from torchx.runner import get_runner
from torchx.specs.finder import ComponentValidationException

from tests.conftest import BIN, run

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

#: A secret in the shape of an AWS secret access key (AWS's documentation example).
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def dryrun(scheduler: str, cfg: str, *component_args: str) -> subprocess.CompletedProcess:
    return run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "--dryrun",
            "-s",
            scheduler,
            "-cfg",
            cfg,
            "--workspace",
            "",
            "components.dlrm:train",
            "-j",
            "1x1",
            *component_args,
        ],
        timeout=120,
    )


def refused(result: subprocess.CompletedProcess, fragment: str) -> bool:
    """Whether ``torchx run`` stopped with an error that says ``fragment``, not a traceback."""
    return result.returncode == 1 and fragment in result.stderr and "Traceback" not in result.stderr


def test_a_queue_that_is_not_a_queue_name_or_arn_never_reaches_the_trainers_command_line():
    # The queue's name is part of the app id, which TorchX writes into `bash -c '... --rdzv_id ...'`.
    result = dryrun("aws_batch", "queue=q';touch /tmp/pwned;'")
    assert refused(result, "queue=\"q';touch /tmp/pwned;'\" is neither a job queue name"), result.stderr
    assert "touch" not in result.stdout


def test_credentials_passed_as_environment_values_are_named_in_a_warning_but_not_shown():
    result = dryrun("aws_batch", "queue=dlrm", "--env", f"AWS_SECRET_ACCESS_KEY={SECRET},HF_TOKEN=hf_x,FOO=1")
    assert result.returncode == 0, result.stderr
    (warning,) = [line for line in result.stderr.splitlines() if "look like credentials" in line]
    assert "AWS_SECRET_ACCESS_KEY, HF_TOKEN look like" in warning and "job_role_arn=" in warning
    assert SECRET not in result.stderr and "hf_x" not in result.stderr


@pytest.mark.parametrize(
    "cfg, fragment",
    [
        # A newline ends the #SBATCH line: the rest would run as the job's shell code.
        ("partition=gpu\ntouch /tmp/pwned", "partition='gpu\\ntouch /tmp/pwned' would change the sbatch script"),
        # A space adds an option of its own to the #SBATCH line.
        ("time=1:00 --exclusive", "time='1:00 --exclusive' would change the sbatch script's #SBATCH line"),
        # A '#' starts a comment there: what follows is silently dropped.
        ("qos=normal#high", "qos takes letters, digits and _ . , : - * & | ! [ ] ( ) + = @ / only"),
        # The script repeats the sbatch command line in a comment, which a newline would end.
        ("comment=run 1\ntouch /tmp/pwned", "comment='run 1\\ntouch /tmp/pwned' has a control character"),
    ],
)
def test_slurm_options_that_would_change_the_sbatch_script_are_refused(cfg, fragment):
    result = dryrun("slurm", cfg)
    assert refused(result, fragment), result.stderr
    assert "pwned" not in result.stdout


@pytest.mark.unit
def test_a_role_name_that_would_change_the_sbatch_script_is_refused():
    role = specs.Role(
        name="train --uid=0", image="", entrypoint="echo", resource=specs.Resource(cpu=1, gpu=0, memMB=64)
    )
    with get_runner() as runner, pytest.raises(ComponentValidationException, match="role name 'train --uid=0'"):
        runner.dryrun(specs.AppDef("app", roles=[role]), "slurm")


def environment_of_srun_command(argv: list[str]) -> dict[str, str]:
    """The variables that srun's command line ``argv`` sets for the command it runs: its
    ``--export`` list, split at every comma as srun splits it, then ``env -- NAME=VALUE`` arguments."""
    env = {}
    command = list(itertools.dropwhile(lambda arg: arg.startswith("--"), argv))
    for option in argv[: len(argv) - len(command)]:
        if option.startswith("--export="):
            # A token without "=" names a variable of srun's own environment to pass on.
            env.update(token.split("=", 1) for token in option.removeprefix("--export=").split(",") if "=" in token)
    if command[:2] == ["env", "--"]:
        env.update(arg.split("=", 1) for arg in itertools.takewhile(lambda arg: "=" in arg, command[2:]))
    return env


def test_slurm_environment_values_reach_the_job_whole(tmp_path):
    """A value with commas (a list of interfaces), quotes and ``$`` is the value the job gets."""
    note = 'it\'s $HOME; "quoted"'
    result = dryrun("slurm", "partition=gpu", "--env", f"NCCL_SOCKET_IFNAME=eth0,eth1,NOTE={note}")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "torchx-sbatch.sh"
    script.write_text(result.stdout[result.stdout.index("#!/bin/bash") :])
    # Run the script as sbatch would, with an srun that records the arguments bash gives it.
    fake_srun = tmp_path / "srun"
    fake_srun.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {tmp_path}/srun.argv\n")
    fake_srun.chmod(0o755)
    ran = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,  # the job's directory: the script makes the run's folder (outputs/dlrm-42) there
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_ID": "42"},
    )
    assert ran.returncode == 0, ran.stderr
    argv = (tmp_path / "srun.argv").read_text().split("\0")[:-1]

    env = environment_of_srun_command(argv)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"
    assert env["NOTE"] == note
    assert env["TORCHX_JOB_ID"] == "slurm://torchx/42"
