"""What a training job would refuse only after it starts, refused while TorchX builds it (so
``--dryrun`` checks too), from the facts at hand: the GPUs the job asks for, and its data where
that is on this machine (apps/dlrm/data/preflight.py)."""

from typing import Mapping

from torchx.specs import AppDef

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections
from apps.core.training.device_support import check_device_support
from apps.core.zch.config import check_world_size
from apps.dlrm.config import JobConfig
from apps.dlrm.data.preflight import check_local_data
from components.launch import Launch
from components.signature import InvalidComponentArgument
from schedulers.local import MISSING_HERE


def check_before_submitting(launch: Launch, cfg: JobConfig) -> list[str]:
    """Raises InvalidComponentArgument, in the app's own words, for GPU-only options on a job
    that asks for no GPUs, and for local data that cannot serve the options. Returns the paths
    the job reads that are not on this machine (``--data_path PATH``): see :func:`needing_here`."""
    check_devices(launch, cfg)
    try:
        return check_local_data(cfg.model, cfg.data)
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None


def needing_here(app: AppDef, missing: list[str]) -> AppDef:
    """``app`` with ``missing`` (paths it reads that this machine lacks) in its roles' metadata:
    on a cluster they may be the nodes' own, but ``-s local_cwd`` runs the job here, and refuses
    it before it starts (schedulers/local.py), where its trainers would refuse it a while later."""
    if missing:
        for role in app.roles:
            role.metadata[MISSING_HERE] = missing
    return app


def check_devices(launch: Launch, cfg: SharedSections) -> None:
    """Raises InvalidComponentArgument for GPU-only options on a job that asks for no GPUs (any app's)."""
    if not launch.gpus_per_node:
        try:
            _check_cpu_job(cfg)
        except ConfigError as e:
            raise InvalidComponentArgument(str(e)) from None


def _check_cpu_job(cfg: SharedSections) -> None:
    try:
        check_device_support(cfg, "cpu")
    except ConfigError as e:
        raise ConfigError(f"{e} (this job asks for no GPUs: for GPU nodes give -h or --gpu)") from None


def check_managed_world(launch: Launch, tables: Mapping[str, int], rows_option: str) -> None:
    """Raises InvalidComponentArgument for managed-collision tables (any app's: each one's rows by
    its name, which ``rows_option`` gives) that a world size the job may train on cannot split:
    its trainers would refuse it once started."""
    try:
        for world_size in launch.world_sizes:
            check_world_size(tables, world_size, rows_option)
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None
