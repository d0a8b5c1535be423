"""``train --check_plan true``: preview the job's sharding plan and refuse to submit one that
does not fit, with the preview of the app's ``plan`` component run in-process while TorchX builds
the job (so ``--dryrun`` checks too). Any app's train component takes it: the preview is
:func:`apps.core.training.plan.check_plan_fits` of the app."""

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

from torchx import specs

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections
from apps.core.launch.target import PlanTarget, check_hbm_gb, known_hbm_gib
from apps.core.options import option
from apps.core.training.app_spec import AppSpec
from components.launch import Launch
from components.signature import InvalidComponentArgument

logger = logging.getLogger(__name__)


@dataclass
class PlanCheck:
    check_plan: bool = option(
        False,
        "Before submitting, plan the embedding tables for this job's ranks (-j, -h or gpu/memMB) "
        "with TorchRec's planner, as the app's plan component does, and refuse to launch if they "
        "do not fit in the ranks' memory.",
    )

    def run(self, launch: Launch, cfg: SharedSections, app: AppSpec) -> None:
        """Raises InvalidComponentArgument, with the plan's verdict, if the plan of ``app``'s job
        does not fit.

        The preview plans with the job's own --hbm_gb (a JobConfig field, which the app also
        plans with), so it predicts the plan the job makes. Without --check_plan, an --hbm_gb that
        the app would refuse at start-up is still refused here, before the job waits in a queue.
        """
        if not self.check_plan:
            _check_hbm_gb(launch, cfg)
            return
        try:
            target = PlanTarget(
                j=launch.j, h=launch.h or "", gpu=launch.gpu, memMB=launch.memMB, hbm_gb=cfg.launch.hbm_gb
            )
            with _info_logs_off():
                # Imported only when asked: planning loads torch and torchrec, building a job does not.
                from apps.core.training.plan import check_plan_fits

                preview = check_plan_fits(app.training().app_for(cfg), cfg, target)
        except ConfigError as e:
            raise InvalidComponentArgument(str(e)) from None
        for line in [*preview.notes(), preview.verdict()]:
            logger.info("--check_plan: %s", line)


#: The most HBM a GPU has (B300: 288 GB): a GPU of no known type counts as this much, so that
#: :func:`check_tables_fit` never refuses a job whose tables could fit.
MAX_GPU_HBM_GIB = 288
FLOAT32_BYTES = 4


def check_tables_fit(launch: Launch, table_rows: list[int], dim: int, option: str, app: AppSpec) -> None:
    """Refuses, before anything is built or submitted, tables whose float32 weights alone are
    more than the whole job's memory (every node's host memory and every GPU's HBM): the job would
    fail at start-up in TorchRec's planner. ``option`` names the tables' sizes for the message,
    whose advice names ``app``'s plan preview.
    A lower bound, so no job that could fit is refused; ``--check_plan`` plans them for real."""
    resource = launch.resource or specs.Resource(cpu=launch.cpu, gpu=launch.gpu, memMB=launch.memMB)
    hbm_gib = (known_hbm_gib(resource) or MAX_GPU_HBM_GIB) if resource.gpu else 0
    nodes = launch.job_size.max_nodes
    has = nodes * (resource.memMB * 2**20 + resource.gpu * hbm_gib * 2**30)
    needs = sum(table_rows) * dim * FLOAT32_BYTES
    if needs > has:
        raise InvalidComponentArgument(
            f"{option}: the embedding tables' weights alone take {needs / 2**30:,.0f} GiB ({sum(table_rows):,} rows "
            f"x {dim} floats), more than the whole job's {has / 2**30:,.0f} GiB of memory ({nodes} node(s) of "
            f"{resource.memMB} MB{f' and {resource.gpu} GPUs' if resource.gpu else ''}): use smaller tables, or more "
            f"or larger nodes (-j, -h, --memMB); components.{app.name}:plan previews where they go"
        )


def _check_hbm_gb(launch: Launch, cfg: SharedSections) -> None:
    resource = launch.resource or specs.Resource(cpu=launch.cpu, gpu=launch.gpu, memMB=launch.memMB)
    try:
        check_hbm_gb(cfg.launch.hbm_gb, resource, launch.h)
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None


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
