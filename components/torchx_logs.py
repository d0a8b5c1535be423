"""Notices of the ``torchx`` command that say nothing to a user of these components, kept out of
its output: ``tracker configurations: {}`` (no experiment tracker is set up) and, on local
schedulers, that TorchX's own copy of the job's output goes to a temporary folder. The run's
results and its trainers' logs are in the run's folder (``--output_dir``), whose path the job
prints.

TorchX has no option for these lines: they are INFO records of its module loggers, and the
``torchx`` CLI shows INFO (``--log_level``). Users run the stock CLI, so what drops them must run
in its process before it logs them: the component module, which ``torchx run components.dlrm:...``
imports to build the job, before TorchX looks up trackers and starts the job. A filter on those
two loggers, by each notice's format string, leaves every other line of theirs as it was, and
only in a process that imported these components.
"""

import logging

#: Logger name -> the format strings of its notices that are dropped.
NOTICES = {
    "torchx.runner.api": ("tracker configurations: %s",),
    "torchx.schedulers.local_scheduler": (
        "Log directory not set in scheduler cfg. Creating a temporary log dir that will be deleted"
        " on exit. To preserve log directory set the `log_dir` cfg option",
        "log directory is: `%s`",
    ),
}


def _keep(record: logging.LogRecord) -> bool:
    """Whether a record is not one of the notices; the tracker one is, only with no tracker."""
    if record.msg == "tracker configurations: %s":
        return record.args != ({},)
    return record.msg not in NOTICES.get(record.name, ())


def drop_notices() -> None:
    """Installs the filter on TorchX's loggers, once however often it is called."""
    for name in NOTICES:
        target = logging.getLogger(name)
        if _keep not in target.filters:
            target.addFilter(_keep)
