"""Train, validate and test a sharded DLRM: ``python -m apps.dlrm.train --help``.

The command: parse the configuration, join the process group, and let a
:class:`~apps.dlrm.training.app.Trainer` run the training; a configuration error is one line, exit 2.
Any other error is a traceback, unless torchrun restarts the trainers after it: then the traceback
goes to the rank's error file only, and torchrun's agent says in one line which rank failed and
how (apps/core/launch/agent.py).
"""

import sys
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from apps.core.checkpoint.storage import SaveFailed
from apps.core.common.distributed import DistEnv, exit_refused, init_distributed, restarts_left
from apps.core.common.errors import ConfigError
from apps.core.training.report import setup_logging
from apps.dlrm.config import TrainConfig, parse_train_config
from apps.dlrm.training.app import Trainer


def train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    """The whole run (:meth:`Trainer.fit`); returns its summary. A checkpoint that could not be
    written (no space left) ends the run, its summary.json saying so."""
    trainer = Trainer(cfg, env)
    try:
        return trainer.fit()
    except SaveFailed as e:
        trainer.record_failure(e)
        raise
    finally:
        trainer.close()  # the last save, still being written, commits before the job ends


@record  # a failing rank's traceback goes to torchrun's error file, which TorchX reports
def main(argv: list[str] | None = None) -> None:
    cfg = parse_train_config(argv)
    env = init_distributed()
    setup_logging(env.rank)
    try:
        train(cfg, env)
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
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
