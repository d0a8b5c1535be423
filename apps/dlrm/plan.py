"""Preview the sharding plan of a DLRM training job: ``python -m apps.dlrm.plan --help``.

The shared preview (:mod:`apps.core.training.plan`) given the DLRM app (:data:`apps.dlrm.spec.SPEC`),
with the options of :class:`~apps.dlrm.config.PlanConfig`; ``components.dlrm:train --check_plan
true`` runs its :func:`~apps.core.training.plan.check_plan_fits` before it launches.
"""

from apps.core.training import plan
from apps.dlrm.config import JobConfig
from apps.dlrm.spec import SPEC
from apps.dlrm.training.app import app_for


def preview(cfg: JobConfig, cluster: plan.Cluster) -> plan.Preview:
    """TorchRec's plan of the DLRM job of ``cfg`` on ``cluster`` (:func:`apps.core.training.plan.preview`)."""
    return plan.preview(app_for(cfg), cfg, cluster)


def main(argv: list[str] | None = None) -> None:
    plan.main(SPEC, argv)


if __name__ == "__main__":
    main()
