"""What a training job would refuse only after it starts, refused while TorchX builds it (so
``--dryrun`` checks too), from the facts at hand: the GPUs the job asks for, and its data where
that is on this machine (apps/dlrm/data/preflight.py)."""

from apps.core.common.errors import ConfigError
from apps.core.config import RunConfig
from apps.core.training.device_support import check_device_support
from apps.dlrm.config import TrainConfig
from apps.dlrm.data.preflight import check_local_data
from components.launch import Launch
from components.signature import InvalidComponentArgument


def check_before_submitting(launch: Launch, cfg: TrainConfig) -> None:
    """Raises InvalidComponentArgument, in the app's own words, for GPU-only options on a job
    that asks for no GPUs, and for local data that cannot serve the options."""
    check_devices(launch, cfg)
    try:
        check_local_data(cfg)
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None


def check_devices(launch: Launch, cfg: RunConfig) -> None:
    """Raises InvalidComponentArgument for GPU-only options on a job that asks for no GPUs (any app's)."""
    if not launch.gpus_per_node:
        try:
            _check_cpu_job(cfg)
        except ConfigError as e:
            raise InvalidComponentArgument(str(e)) from None


def _check_cpu_job(cfg: RunConfig) -> None:
    try:
        check_device_support(cfg, "cpu")
    except ConfigError as e:
        raise ConfigError(f"{e} (this job asks for no GPUs: for GPU nodes give -h or --gpu)") from None
