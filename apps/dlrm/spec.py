"""The DLRM app as the shared commands and its components take it (:class:`~apps.core.training.app_spec.AppSpec`)."""

from apps.core.training.app_spec import AppSpec, AppTraining
from apps.dlrm.config import NAME, JobConfig, PlanConfig, parse_train_config


def _training() -> AppTraining:
    from apps.dlrm.training.app import Trainer, app_for  # torch and torchrec: imported where the app trains

    return AppTraining(app_for, Trainer)


#: The DLRM app.
SPEC = AppSpec(NAME, JobConfig, PlanConfig, parse_train_config, _training)
