"""Preview the sharding plan of a DLRM training job: ``python -m apps.dlrm.plan --help``.

The shared preview (:mod:`apps.core.training.plan`) of the DLRM app, with the options of
:class:`~apps.dlrm.config.PlanConfig`; ``components.dlrm:train --check_plan true`` runs
:func:`check_plan_fits` before it launches.
"""

from apps.core.launch.target import PlanTarget
from apps.core.training import plan
from apps.dlrm.config import JobConfig, PlanConfig
from apps.dlrm.training.app import app_for


def preview(cfg: JobConfig, cluster: plan.Cluster) -> plan.Preview:
    """TorchRec's plan of the DLRM job of ``cfg`` on ``cluster`` (:func:`apps.core.training.plan.preview`)."""
    return plan.preview(app_for(cfg), cfg, cluster)


def check_plan_fits(cfg: JobConfig, target: PlanTarget) -> plan.Preview:
    """The preview of a DLRM job about to be launched; raises ConfigError if its plan does not fit."""
    return plan.check_plan_fits(app_for(cfg), cfg, target)


def main(argv: list[str] | None = None) -> None:
    plan.main(app_for, PlanConfig, "dlrm", argv)


if __name__ == "__main__":
    main()
