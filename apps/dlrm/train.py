"""Train, validate and test a sharded DLRM: ``python -m apps.dlrm.train --help``.

The shared training command (:func:`apps.core.training.command.main`) given the DLRM app
(:data:`apps.dlrm.spec.SPEC`).
"""

from apps.core.common.startup import imports_uncollected
from apps.core.common.teardown import exit_without_teardown

with imports_uncollected():  # ~0.9 s of each trainer's start (see the module)
    from apps.core.training import command
    from apps.dlrm.spec import SPEC


def main(argv: list[str] | None = None) -> None:
    command.main(SPEC, argv)


if __name__ == "__main__":
    exit_without_teardown(main)
