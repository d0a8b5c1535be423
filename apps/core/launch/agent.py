"""What torchrun's agent says when trainers fail: one line that names the rank that failed first
and how. torchrun's own account is a line at INFO for a restart, which TorchX's
``LOGLEVEL=WARNING`` hides, and for any failure two lines of its internals (the process it
signalled, the local rank and pid that failed), which this module drops.

Trainers that fail on a refused option or data (exit 2, :func:`is_refused`) are not restarted:
a configuration error fails again on every attempt. A restart reads as one line, ``rank 1 died (SIGKILL); restarting the trainers (restart 1 of
1); the failed attempt's logs and errors: FOLDER``, followed by the trainer's ``resumed from ...
(step N)``: the surviving ranks, which fail on the lost rank's absence, keep their tracebacks out
of the log while a restart follows (apps/dlrm/train.py), in their error files in that folder.

torchrun offers no hook into its restarts: :func:`report_restarts` has its launcher build
:class:`ReportingAgent`, a LocalElasticAgent that reports before it restarts.
"""

import logging
import os
import signal

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.launcher import api as launcher

from apps.core.common.distributed import REFUSALS_FOLDER, refusal_file
from apps.core.common.errors import REFUSED

#: The launcher's logger (apps/core/torchrun.py prints its lines, naming the app's command).
LAUNCHER_LOGGER = "apps.core.torchrun"
logger = logging.getLogger(LAUNCHER_LOGGER)

#: torchrun's lines about a failure, which this module's line (a restart) and apps/core/torchrun.py's
#: (the end of the job) say instead: by their format strings, so that its other lines still show.
TORCH_FAILURE_LINES = frozenset(
    {
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        "Sending process %s closing signal %s",
    }
)
_TORCH_PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"
#: The most of an error message a line quotes: gloo's run to a few hundred characters.
MESSAGE_CHARS = 160


class ReportingAgent(LocalElasticAgent):
    """torchrun's agent, which says in one line why it restarts the trainers."""

    _last_result: RunResult | None = None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torchrun's reading of the trainers; where they failed on a refused option or data
        (:func:`is_refused`), no restart is left: they would be refused again."""
        self._last_result = result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and result.failures and is_refused(root_failure(result.failures)[1]):
            self._remaining_restarts = 0
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        result = self._last_result
        if result is None or result.state == WorkerState.HEALTHY:  # a node joins an elastic job
            logger.warning("a node is joining the job: restarting the trainers with it (this uses up no restart)")
        else:
            spec = worker_group.spec
            logger.warning(
                "%s; restarting the trainers (restart %d of %d)%s",
                describe_failure(*root_failure(result.failures))
                if result.failures
                else f"the trainers are {result.state.name.lower()}",
                spec.max_restarts - self._remaining_restarts,
                spec.max_restarts,
                self._attempt_logs(),
            )
        super()._restart_workers(worker_group)

    def _attempt_logs(self) -> str:
        """Where the failed attempt's logs and error files are (in torchrun's ``--log_dir``), for
        the line."""
        error_files = self._pcontext.error_files.values() if self._pcontext else ()
        # <log_dir>/<run id>/attempt_<n>/<local rank>/error.json; os.devnull for --log_dir /dev/null
        folders = {os.path.dirname(os.path.dirname(path)) for path in error_files if path != os.devnull}
        return f"; the failed attempt's logs and errors: {folders.pop()}" if len(folders) == 1 else ""


def root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank whose failure caused the others, and its failure: a rank killed by a signal (the
    others fail on its absence, or torchrun stops them with SIGTERM), else the earliest to fail."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, int]:
        failure = item[1]
        stopped = failure.exitcode == -signal.SIGTERM
        return (0 if failure.exitcode < 0 and not stopped else 2 if stopped else 1, failure.timestamp)

    return min(failures.items(), key=order)


def is_refused(failure: ProcessFailure) -> bool:
    """Whether a rank ended on a refused option or data (a configuration error), which no restart
    of the job can get past."""
    return failure.exitcode == REFUSED


def describe_failure(rank: int, failure: ProcessFailure) -> str:
    """A rank's failure in words: ``rank 1 died (SIGKILL)``, ``rank 0 exited with 2: --data_path
    ...`` (the option or data it refused, whole), ``rank 0 exited with 1: RuntimeError: ...`` (the
    error it recorded, shortened) or ``rank 0 exited with 2``."""
    if failure.exitcode < 0:
        return f"rank {rank} died ({failure.signal_name()})"
    message = failure_message(failure)
    return f"rank {rank} exited with {failure.exitcode}" + (f": {message}" if message else "")


def failure_message(failure: ProcessFailure) -> str:
    """What a rank said about its failure: the option or data it refused
    (:func:`~apps.core.common.distributed.exit_refused`), else the error it recorded; empty where
    it said nothing."""
    refusal = refusal_file(os.environ[REFUSALS_FOLDER], failure.pid) if REFUSALS_FOLDER in os.environ else ""
    if refusal and os.path.isfile(refusal):
        with open(refusal) as f:
            return f.read().strip()
    return recorded_error(failure)


def recorded_error(failure: ProcessFailure) -> str:
    """The first line of the error a rank recorded in its error file (``@record``), at most
    MESSAGE_CHARS long; empty where it recorded none."""
    if not os.path.isfile(failure.error_file):  # torchrun's "<N/A>": none was written
        return ""
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    line = str(message).strip().split("\n", 1)[0]
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


def report_restarts() -> None:
    """Has torchrun's launcher, in this process, build :class:`ReportingAgent`, and drops
    torchrun's own lines about a failure (:data:`TORCH_FAILURE_LINES`)."""
    if not issubclass(ReportingAgent, launcher.LocalElasticAgent):
        raise AssertionError("torch.distributed.launcher.api no longer builds a LocalElasticAgent")
    launcher.LocalElasticAgent = ReportingAgent  # type: ignore[misc]  # a class the launcher builds by name
    logging.getLogger(_TORCH_PROCESSES_LOGGER).addFilter(lambda record: record.msg not in TORCH_FAILURE_LINES)
