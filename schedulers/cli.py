"""TorchX's commands that read a submitted job (``status``, ``describe``, ``log``, ``cancel``,
``delete``, ``list``), each printing a mistake of the command line or of the machine's setup as one
line and exit status 1, where TorchX's print a traceback through its frames and the client
library's.

The mistakes: an app handle that is not one (``torchx status foo``), a scheduler that is not there
(``nope://...``), an app id the scheduler cannot read (``kubeflow://torchx/bad``), an app it does not
know (``torchx log`` of a ``local_cwd`` app, which only its ``torchx run`` knows), and what the
schedulers refuse in one line anyway (:class:`~schedulers.setup_checks.SetupError`: ``squeue``
not on PATH, no AWS region or credentials, a kubeconfig that is not there). Any other exception
keeps its traceback; with ``--log_level DEBUG`` these do too.

Registered as ``[torchx.cli.cmds]`` entry points (setup.py), which replace TorchX's commands of the
same names; everything else about them is TorchX's.
"""

import argparse
import logging
import sys
import threading

from torchx.cli.cmd_cancel import CmdCancel
from torchx.cli.cmd_delete import CmdDelete
from torchx.cli.cmd_describe import CmdDescribe
from torchx.cli.cmd_list import CmdList
from torchx.cli.cmd_log import CmdLog
from torchx.cli.cmd_status import CmdStatus
from torchx.schedulers import get_scheduler_factories
from torchx.specs.api import MalformedAppHandleException, UnknownAppException, UnknownSchedulerException
from torchx.specs.finder import ComponentValidationException

from schedulers.local import RUN_FOLDERS
from schedulers.setup_checks import first_line

logger = logging.getLogger(__name__)

#: What the command line or the machine's setup got wrong: said in one line. ValueError is what the
#: schedulers raise for an app id they cannot read.
MISTAKES = (
    MalformedAppHandleException,
    UnknownSchedulerException,
    UnknownAppException,
    ComponentValidationException,
    ValueError,
)


class _OneLineMistakes:
    """Runs TorchX's command (the next class in the MRO), saying a mistake in one line."""

    command: str

    def run(self, args: argparse.Namespace) -> None:
        threading.excepthook = _quiet_about_mistakes
        try:
            super().run(args)  # type: ignore[misc]
        except MISTAKES as e:
            logger.debug("torchx %s failed", self.command, exc_info=True)
            print(f"torchx {self.command}: {_said(e)}", file=sys.stderr)
            sys.exit(1)


def _quiet_about_mistakes(hook_args: threading.ExceptHookArgs) -> None:
    """``torchx log`` reads each replica's log in a thread that hands its exception to the command
    and raises it again: a mistake's traceback is not printed from there (the command says it)."""
    if isinstance(hook_args.exc_value, MISTAKES) and not logger.isEnabledFor(logging.DEBUG):
        return
    threading.__excepthook__(hook_args)


def _said(error: Exception) -> str:
    if isinstance(error, UnknownSchedulerException):  # TorchX's names a Python API as the fix
        name = str(error).split("Scheduler backend: ", 1)[-1].split(" does not exist", 1)[0]
        known = ", ".join(sorted(get_scheduler_factories()))
        return f"no scheduler {name!r} here: an app handle starts with one of {known}"
    if isinstance(error, UnknownAppException):  # TorchX's asks whether session.run() was called
        handle = str(error).split("Unknown app = ", 1)[-1].split(". ", 1)[0]
        if handle.startswith(("local_cwd://", "local_docker://")):
            return (
                f"{handle} is not running in this process: a local app is known only to its `torchx run`; {RUN_FOLDERS}"
            )
        return f"the scheduler knows no app {handle}: check the handle `torchx run` printed"
    return first_line(error)


def _saying_mistakes_in_one_line(command: str, base: type) -> type:
    """TorchX's ``base`` command class, saying a mistake in one line."""
    return type(command.capitalize(), (_OneLineMistakes, base), {"command": command})


Status = _saying_mistakes_in_one_line("status", CmdStatus)
Describe = _saying_mistakes_in_one_line("describe", CmdDescribe)
Log = _saying_mistakes_in_one_line("log", CmdLog)
Cancel = _saying_mistakes_in_one_line("cancel", CmdCancel)
Delete = _saying_mistakes_in_one_line("delete", CmdDelete)
List = _saying_mistakes_in_one_line("list", CmdList)
