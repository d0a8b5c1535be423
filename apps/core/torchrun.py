"""torchrun for every app's trainers: this host's address chosen for multi-node jobs, and a quiet log.

    python -m apps.dlrm.torchrun TORCHRUN_ARGS...     (each app has its command: apps/<app>/torchrun.py)

takes torchrun's own arguments and runs torchrun (``torch.distributed.run``) in this process.
For a job of more than one node it first completes them with how the other hosts reach this one
(:mod:`apps.core.launch.torchrun_args`: ``--local_addr``, ``--rdzv_conf is_host=1``,
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``), which torchrun and the trainers would
otherwise guess from the hostname, wrongly wherever it resolves to loopback. What the user set is
kept. On every job it also sets the trainers' ``OMP_NUM_THREADS`` (this host's cores shared
among them, :func:`~apps.core.launch.torchrun_args.trainer_threads`), names the run's folder in
torchrun's ``--log_dir`` and refuses a folder that holds files of no run before torchrun writes
into it (:func:`~apps.core.training.run_folder.torchrun_log_dir`), and says in
one line why it restarts the trainers or why the job failed (:mod:`apps.core.launch.agent`), in
place of torchrun's warnings, tracebacks and failure table. The components run every trainer
through it (components/launch.py).
"""

import gc
import logging
import os
import socket
import sys
import tempfile
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main
from torch.distributed.run import parse_args

from apps.core.common.distributed import REFUSALS_FOLDER, record_refusal
from apps.core.common.errors import REFUSED, ConfigError
from apps.core.launch.agent import (
    LAUNCHER_LOGGER,
    describe_failure,
    failure_message,
    is_refused,
    report_restarts,
    root_failure,
)
from apps.core.launch.torchrun_args import multi_node_args, trainer_threads
from apps.core.training.app_spec import AppSpec
from apps.core.training.run_folder import torchrun_log_dir

logger = logging.getLogger(LAUNCHER_LOGGER)


def main(app: AppSpec, argv: list[str] | None = None) -> None:
    """The command ``python -m apps.<app>.torchrun``: its lines say that module's name."""
    prog = app.module("torchrun")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prog}: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args, variables = multi_node_args(args, dict(os.environ))
        os.environ.update(variables)
        _prepare_trainers(args, app.name)
    except ConfigError as e:
        _exit_refused(f"{prog}: {e}")
    report_restarts()
    with tempfile.TemporaryDirectory(prefix="refusals-") as folder:
        os.environ[REFUSALS_FOLDER] = folder  # the trainers leave a refusal there for our line
        try:
            _run_torchrun(prog, args)
        finally:
            gc.freeze()  # a quick exit: the teardown need not walk what the imports made


def _run_torchrun(prog: str, args: list[str]) -> None:
    try:
        torchrun_main(args)
    except ChildFailedError as e:
        # One line here, quoting the rank's refusal or recorded error (@record gave TorchX its
        # traceback), not torchrun's traceback and failure table.
        rank, failure = root_failure(e.failures)
        line = f"{prog}: {e.name} failed on {socket.gethostname()}: {describe_failure(rank, failure)}"
        if is_refused(failure):
            _exit_refused(line)
        sys.exit(line + ("; its error is above" if failure.exitcode > 0 and not failure_message(failure) else ""))


def _exit_refused(line: str) -> NoReturn:
    """Ends the launcher on a refused option or data: ``line`` is the job's last line and its
    recorded error (TorchX's ``structured_error_msg``), and the exit status, :data:`REFUSED`, tells
    the scheduler that retrying cannot help."""
    record_refusal(line)
    print(line, file=sys.stderr)
    sys.exit(REFUSED)


def _prepare_trainers(args: list[str], app: str) -> None:
    """Sets the trainers' OMP_NUM_THREADS, and names (after the job, else after the ``app``) and
    checks the run's folder in torchrun's log folder (PET_LOG_DIR, which the training component
    sets; a --log_dir flag would take precedence) before torchrun writes into it: ConfigError for
    a folder the trainers would refuse."""
    parsed = parse_args(args)  # torchrun's own reading: its flags, else their PET_ variables
    os.environ.update(trainer_threads(parsed.nproc_per_node, dict(os.environ)))
    if "PET_LOG_DIR" in os.environ:
        os.environ["PET_LOG_DIR"] = torchrun_log_dir(os.environ["PET_LOG_DIR"], os.environ, parsed.rdzv_id, app)
