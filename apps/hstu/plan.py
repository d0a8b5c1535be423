"""Preview the sharding plan of an HSTU training job: ``python -m apps.hstu.plan --help``.

The shared preview (:mod:`apps.core.training.plan`) of the HSTU app, with the options of
:class:`~apps.hstu.config.PlanConfig`; ``components.hstu:train --check_plan true`` runs
:func:`check_plan_fits` before it launches.
"""

from apps.core.launch.target import PlanTarget
from apps.core.training import plan
from apps.hstu.config import JobConfig, PlanConfig
from apps.hstu.training.app import HSTU


def check_plan_fits(cfg: JobConfig, target: PlanTarget) -> plan.Preview:
    """The preview of an HSTU job about to be launched; raises ConfigError if its plan does not fit."""
    return plan.check_plan_fits(HSTU, cfg, target)


def main(argv: list[str] | None = None) -> None:
    plan.main(lambda cfg: HSTU, PlanConfig, "hstu", argv)


if __name__ == "__main__":
    main()
