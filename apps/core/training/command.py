"""Every app's training command (``python -m apps.<app>.train``: :func:`main`, given the app's
:class:`~apps.core.training.app_spec.AppSpec`): parse the configuration, join the process group, and let
the app's :class:`~apps.core.training.trainer.Trainer` run the training; a configuration error is
one line, exit 2. Any other error is a traceback, unless torchrun restarts
the trainers after it: then the traceback goes to the rank's error file only, and torchrun's agent
says in one line which rank failed and how (apps/core/launch/agent.py).
"""

import sys
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from apps.core.checkpoint.lease import release_held
from apps.core.checkpoint.storage.errors import SaveFailed
from apps.core.common.distributed import DistEnv, exit_refused, init_distributed, leave_process_group, restarts_left
from apps.core.common.errors import ConfigError
from apps.core.common.startup import imports_uncollected
from apps.core.config import SharedSections
from apps.core.training.app_spec import AppSpec
from apps.core.training.report import setup_logging
from apps.core.training.trainer import Trainer

#: Builds a run's Trainer (collective) from its config and process group: the app's.
MakeTrainer = Callable[[Any, DistEnv], Trainer]


def train(trainer: Trainer) -> dict[str, Any]:
    """The whole run (:meth:`Trainer.fit`); returns its summary. A checkpoint that could not be
    written (no space left) ends the run, its summary.json saying so."""
    try:
        return trainer.fit()
    except SaveFailed as e:
        trainer.record_failure(e)
        raise
    finally:
        trainer.close()  # the last save, still being written, commits before the job ends


@record  # a failing rank's traceback goes to torchrun's error file, which TorchX reports
def main(app: AppSpec, argv: list[str] | None = None) -> None:
    """The command ``python -m apps.<app>.train``: ``argv`` (else the process's) parsed by the
    app, then the run of its Trainer in this process's group."""
    cfg = app.parse_train_config(argv)
    with imports_uncollected():  # the app's model and data modules, as its command imports the rest
        make_trainer = app.training().trainer
    run(cfg, make_trainer)


def run(cfg: SharedSections, make_trainer: MakeTrainer) -> None:
    """The command, once its configuration is parsed: the run in this process's group."""
    env = init_distributed()
    setup_logging(env.rank)
    try:
        train(make_trainer(cfg, env))
    except ConfigError as e:
        exit_refused(e, env)
    except Exception as e:
        if not restarts_left():
            raise
        # Mostly a collective that lost the rank which failed first: ranks' tracebacks would bury
        # the agent's one line about it. Kept in this rank's error file, which the line names.
        get_error_handler().record_exception(e)
        sys.exit(1)
    finally:
        release_held()  # where the run failed before its Checkpointer, which releases it, closed
        leave_process_group()
