"""Train, validate and test a sharded HSTU generative recommender: ``python -m apps.hstu.train --help``.

The shared training command (:mod:`apps.core.training.command`) with the HSTU's configuration and
:class:`~apps.hstu.training.app.Trainer`.
"""

from typing import Any

from apps.core.common.startup import imports_uncollected
from apps.core.common.teardown import exit_without_teardown

with imports_uncollected():  # ~0.9 s of each trainer's start (see the module)
    from torch.distributed.elastic.multiprocessing.errors import record

    from apps.core.common.distributed import DistEnv
    from apps.core.training import command
    from apps.hstu.config import JobConfig, parse_train_config
    from apps.hstu.training.app import Trainer


def train(cfg: JobConfig, env: DistEnv) -> dict[str, Any]:
    """The whole run of ``cfg`` in this process group; returns its summary."""
    return command.train(Trainer(cfg, env))


@record  # a failing rank's traceback goes to torchrun's error file, which TorchX reports
def main(argv: list[str] | None = None) -> None:
    command.run(parse_train_config(argv), Trainer)


if __name__ == "__main__":
    exit_without_teardown(main)
