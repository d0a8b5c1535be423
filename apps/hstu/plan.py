"""Preview the sharding plan of an HSTU training job: ``python -m apps.hstu.plan --help``.

The shared preview (:mod:`apps.core.training.plan`) of the HSTU app, with the options of
:class:`~apps.hstu.config.PlanConfig`.
"""

from apps.core.training import plan
from apps.hstu.config import PlanConfig
from apps.hstu.training.app import HSTU


def main(argv: list[str] | None = None) -> None:
    plan.main(HSTU, PlanConfig, "hstu", argv)


if __name__ == "__main__":
    main()
