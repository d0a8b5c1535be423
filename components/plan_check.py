"""``train --check_plan true``: preview the job's sharding plan and refuse to submit one that
does not fit, with the preview of ``components.dlrm:plan`` run in-process while TorchX builds
the job (so ``--dryrun`` checks too)."""

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

from apps.dlrm.config import TrainConfig
from apps.dlrm.options import ConfigError, option
from apps.dlrm.target import PlanTarget, hbm_gb_option
from components.launch import Launch
from components.signature import InvalidComponentArgument

logger = logging.getLogger(__name__)


@dataclass
class PlanCheck:
    check_plan: bool = option(
        False,
        "Before submitting, plan the embedding tables for this job's ranks (-j, -h or gpu/memMB) "
        "with TorchRec's planner, as components.dlrm:plan does, and refuse to launch if they do "
        "not fit in the ranks' memory.",
    )
    hbm_gb: float = hbm_gb_option()

    def __post_init__(self) -> None:
        if self.hbm_gb < 0:
            raise ConfigError(f"--hbm_gb {self.hbm_gb} must be 0 or more")
        if self.hbm_gb and not self.check_plan:
            raise ConfigError(f"--hbm_gb {self.hbm_gb} is only used by --check_plan true: add it")

    def run(self, launch: Launch, cfg: TrainConfig) -> None:
        """Raises InvalidComponentArgument, with the plan's verdict, if the plan does not fit."""
        if not self.check_plan:
            return
        try:
            target = PlanTarget(
                j=launch.j, h=launch.h or "", gpu=launch.gpu, memMB=launch.memMB, hbm_gb=self.hbm_gb
            )
            with _info_logs_off():
                # Imported only when asked: planning loads torch and torchrec, building a job does not.
                from apps.dlrm.plan import check_plan_fits

                verdict = check_plan_fits(cfg, target).verdict()
        except ConfigError as e:
            raise InvalidComponentArgument(str(e)) from None
        logger.info("--check_plan: %s", verdict)


@contextlib.contextmanager
def _info_logs_off() -> Iterator[None]:
    """TorchX's CLI logs at INFO, where FBGEMM's import and TorchRec's planner write dozens of
    lines (some to the root logger itself): the check's verdict is the line that matters."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)
