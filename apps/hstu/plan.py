"""Preview the sharding plan of an HSTU training job: ``python -m apps.hstu.plan --help``.

The shared preview (:mod:`apps.core.training.plan`) given the HSTU app (:data:`apps.hstu.spec.SPEC`),
with the options of :class:`~apps.hstu.config.PlanConfig`; ``components.hstu:train --check_plan
true`` runs its :func:`~apps.core.training.plan.check_plan_fits` before it launches.
"""

from apps.core.training import plan
from apps.hstu.spec import SPEC


def main(argv: list[str] | None = None) -> None:
    plan.main(SPEC, argv)


if __name__ == "__main__":
    main()
