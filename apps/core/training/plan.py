"""Preview the sharding plan of any app's training job: ``python -m apps.<app>.plan --help``.

Runs TorchRec's planner as a dry run -- no process group, no GPU, a few seconds -- for the job
that ``components.<app>:train`` launches with the same ``-j``/``-h`` and model options, prints
where each embedding table goes and how much HBM and host memory each rank needs by TorchRec's
own estimates, and says plainly whether it fits. ``torchx run components.<app>:plan`` runs an
app's plan command; ``components.dlrm:train --check_plan true`` runs the same check before it
launches.
"""

import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Iterator, cast

import torch
from torch import nn

# TorchRec's own per-rank memory accounting, the figures its planner stats table prints. Private,
# and no public API gives them: their signatures are the same in torchrec 1.6.1 and 1.8.0 as
# called here (tests/integration/test_plan.py exercises them on both rows: `make test` and `make test-gpu-row`).
from torchrec.distributed.planner.stats import (
    _collapse_consecutive_ranks,
    _compute_mem_usage_and_perf,
    _compute_storage,
)
from torchrec.distributed.planner.types import (
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Stats,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import ShardingPlan

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections, check_int8_comms, with_device_defaults
from apps.core.launch.target import GPU_HBM_GIB, Cluster, GiB, PlanTarget
from apps.core.options import add_options, build_parser, options_of
from apps.core.training.app import C, TrainingApp
from apps.core.training.app_spec import AppSpec
from apps.core.training.device_support import check_device_support
from apps.core.training.sharding import (
    Sharder,
    make_planner,
    make_topology,
    model_to_shard,
    planner_offers,
    table_names,
)
from apps.core.zch import modules as zch

#: The exit status of a plan that does not fit: neither 1, Python's own for an uncaught exception,
#: nor 2, a bad option, so that a script tells the verdict from a crash (benchmarks/gpu_check.py).
DOES_NOT_FIT = 3

#: Without memory limits the planner always finds a placement: it shows what a job that does not
#: fit would need on each rank.
UNLIMITED = 2**60

ADVICE = "use more ranks (-j), nodes with more memory (-h, --hbm_gb, --memMB) or smaller tables"


class _PlannerReport(Stats):
    """What the planner reports about the plan it chose (TorchRec hands it only to its Stats)."""

    best_plan: list[ShardingOption]
    topology: Topology
    storage_reservation: StorageReservation

    def log(
        self,
        sharding_plan: ShardingPlan,
        topology: Topology,
        batch_size: int,
        storage_reservation: StorageReservation,
        num_proposals: int,
        num_plans: int,
        run_time: float,
        best_plan: list[ShardingOption],
        *args: object,
        **kwargs: object,
    ) -> None:
        self.best_plan, self.topology = best_plan, topology
        self.storage_reservation = storage_reservation


@dataclass
class Preview:
    cluster: Cluster
    batch_size: int
    plan: ShardingPlan  # what the training job would be sharded with (if it fits)
    tables: list[ShardingOption]  # TorchRec's placement, in table order, with shard storage
    hbm_used: list[int]  # bytes per rank: its shards, the dense part and the input features
    ddr_used: list[int]
    hbm_usable: int  # bytes per rank the planner may fill: HBM less its reserve
    reserve_percent: float
    fits: bool
    planner_error: str = ""  # why the planner found no plan, when it did not
    #: When it does not fit: the largest batch per rank whose plan fits (0: not even one sample's).
    largest_batch: int = 0
    device_defaults: str = ""  # what the defaults of the ranks' device chose (with_device_defaults)
    #: Bytes per rank of managed-collision tables' id maps (--categorical_ids zch), in the used figures.
    id_maps: int = 0

    def notes(self) -> list[str]:
        """What the plan was made with that no option gave: this machine's GPU memory, the
        defaults of the ranks' device; what it counts beyond TorchRec's estimates."""
        id_maps = (
            f"managed-collision id maps (zch tables): {_gib(self.id_maps)} per rank, counted in "
            "each rank's memory below (TorchRec's planner does not count them)"
            if self.id_maps
            else ""
        )
        return [line for line in (self.cluster.hbm_source, self.device_defaults, id_maps) if line]

    def verdict(self) -> str:
        """One line: ``fits: ...`` or ``does not fit: needs X GiB HBM on rank r, has Y ...``."""
        cuda = self.cluster.device == "cuda"
        if self.fits:
            peaks = [_peak(self.hbm_used, self.hbm_usable, "usable HBM")] if cuda else []
            peaks.append(_peak(self.ddr_used, self.cluster.ddr_per_rank, "host memory"))
            return "fits: at most " + " and ".join(peaks)
        limits = [("host memory", self.ddr_used, self.cluster.ddr_per_rank)]
        if cuda:
            limits.insert(0, ("HBM", self.hbm_used, self.hbm_usable))
        short = [
            (used / max(has, 1), kind, rank, used, has)
            for kind, usage, has in limits
            for rank, used in enumerate(usage)
            if used > has
        ]
        if not short:  # the placement without limits happens to fit: say what the planner said
            return f"does not fit: TorchRec's planner found no placement ({self.planner_error}); {self._advice()}"
        _, kind, rank, used, has = max(short, key=lambda s: s[0])  # the first, of equals
        text = f"does not fit: needs {_gib(used)} {kind} on rank {rank}, has {_gib(has)}"
        if kind == "HBM":
            text += (
                f" ({_gib(self.cluster.hbm_per_rank)} less the {self.reserve_percent:.0%} "
                "TorchRec's planner keeps free), and no placement fits with tables cached from its "
                f"{_gib(self.cluster.ddr_per_rank)} of host memory either"
            )
        return f"{text}; {self._advice()}"

    def _advice(self) -> str:
        """What would make it fit: the largest batch that does, if a smaller batch does."""
        if not self.largest_batch:
            return ADVICE
        return f"--batch_size {self.largest_batch} is the largest that fits (this is {self.batch_size}): give that or less, or {ADVICE}"

    def render(self) -> str:
        """The plan, one line per table and one per rank, then the verdict."""
        kinds = {"HBM": "hbm", "host memory": "ddr"} if self.cluster.device == "cuda" else {"host memory": "ddr"}
        per_rank = {"hbm": self.hbm_used, "ddr": self.ddr_used}
        header = f"TorchRec sharding plan for {self.cluster.describe()}, batch {self.batch_size} per rank"
        if not self.fits:
            header += " -- placed without memory limits, to show what it needs"
        capacity = f"{_gib(self.cluster.ddr_per_rank)} host memory"
        if "hbm" in kinds.values():
            capacity = f"{_gib(self.cluster.hbm_per_rank)} HBM ({_gib(self.hbm_usable)} usable), {capacity}"
        tables = [["table", "rows", "dim", "sharding", "kernel", "ranks", *kinds]]
        for option in self.tables:
            ranks = sorted({shard.rank for shard in option.shards})
            tables.append(
                [
                    option.name,
                    f"{option.tensor.shape[0]:,}",
                    str(option.tensor.shape[1]),
                    option.sharding_type,
                    option.compute_kernel,
                    ",".join(_collapse_consecutive_ranks(ranks)),
                    *(_gib(sum(getattr(shard.storage, kind) for shard in option.shards)) for kind in kinds.values()),
                ]
            )
        ranks = [["rank", *kinds]] + [
            [str(rank), *(_gib(per_rank[kind][rank]) for kind in kinds.values())]
            for rank in range(self.cluster.world_size)
        ]
        return "\n".join(
            [
                header,
                f"per rank: {capacity}",
                *self.notes(),
                "",
                *_columns(tables),
                "",
                *_columns(ranks),
                "(a rank's memory: its table shards with their optimizer state, plus TorchRec's "
                "estimates for the dense part and the input features)",
                "",
                self.verdict(),
            ]
        )


def preview(app: TrainingApp[C], cfg: C, cluster: Cluster) -> Preview:
    """TorchRec's plan for ``app``'s ``cfg`` on ``cluster``, and each rank's memory, without any GPU.

    The model is built and its optimizer fused exactly as the training app does, on the meta
    device, so the planner sees the same tables and estimates the same storage; with the batch the
    job gets on the cluster's device (:func:`with_device_defaults`).
    """
    cfg, device_defaults = with_device_defaults(cfg, cluster.device)
    check_device_support(cfg, cluster.device)
    model, sharders = model_to_shard(app, cfg, dense_device=torch.device("meta"))
    if not planner_offers(cfg.launch, sharders, cluster.device):
        raise ConfigError(
            f"--sharding_type {cfg.launch.sharding_type}: TorchRec's planner offers no row-wise kinds for "
            "CPU ranks (the app builds that plan itself at start-up), so it cannot estimate this "
            "plan; preview the job on GPUs (-h, or --gpu with --hbm_gb) or use another sharding type"
        )
    report, largest_batch = _PlannerReport(), 0
    plan, error = _plan_within(app, cfg, model, sharders, _topology(cluster), report)
    if plan is None:
        largest_batch = _largest_fitting_batch(app, cfg, model, sharders, _topology(cluster))
        try:
            plan = _offline_plan(app, cfg, model, sharders, _topology(cluster, unlimited=True), report)
        except PlannerError as unlimited:
            raise ConfigError(f"TorchRec's planner found no plan: {_first_line(unlimited)}") from None
    check_int8_comms(cfg.launch, [option.sharding_type for option in report.best_plan])
    # The reservation alone: torchrec 1.6.1 takes nothing else, and 1.8.0's optional topology
    # only serves FixedAbsoluteStorageReservation, not the heuristical one we plan with.
    reserve, dense, kjt = _compute_storage(report.storage_reservation)
    _, hbm_used, ddr_used, _ = _compute_mem_usage_and_perf(report.topology, report.best_plan, dense, kjt)
    id_maps = _id_map_bytes(app, cfg, model, cluster.world_size)
    if cluster.device == "cuda":  # they live where the tables do
        hbm_used = [used + id_maps for used in hbm_used]
    else:
        ddr_used = [used + id_maps for used in ddr_used]
    order = {table: i for i, table in enumerate(table_names(model, app.tables))}
    return Preview(
        cluster=cluster,
        batch_size=cfg.training.batch_size,
        plan=plan,
        tables=sorted(report.best_plan, key=lambda option: order[option.name]),
        hbm_used=hbm_used,
        ddr_used=ddr_used,
        hbm_usable=int(cluster.hbm_per_rank * (1 - reserve)),
        reserve_percent=reserve,
        fits=not error,
        planner_error=error,
        largest_batch=largest_batch,
        device_defaults=device_defaults,
        id_maps=id_maps,
    )


def _id_map_bytes(app: TrainingApp[C], cfg: C, model: nn.Module, world_size: int) -> int:
    """Bytes per rank of the managed-collision id maps (--categorical_ids zch, --zch_columns), which
    TorchRec's planner does not count; 0 for other tables."""
    factors = app.pooling_factors(cfg)
    ids = {table: cfg.training.batch_size * factors.get(table, 1.0) for table in table_names(model, app.tables)}
    managed = [module for module in app.tables.modules if module.managed]
    return sum(zch.bytes_per_rank(model.get_submodule(module.path), world_size, ids) for module in managed)


def check_plan_fits(app: TrainingApp[C], cfg: C, target: PlanTarget) -> Preview:
    """The preview of a job about to be launched; raises ConfigError if its plan does not fit."""
    result = preview(app, cfg, target.cluster)
    if not result.fits:
        raise ConfigError(f"--check_plan: {result.verdict()}")
    return result


def _largest_fitting_batch(
    app: TrainingApp[C], cfg: C, model: nn.Module, sharders: list[Sharder], topology: Topology
) -> int:
    """The largest batch per rank, below ``cfg``'s (which does not fit), whose plan fits
    ``topology``; 0 if not even one sample's does.

    TorchRec's planner sizes each shard with the batch (its input ids and pooled outputs, and the
    input features it keeps room for on each rank: ``calculate_shard_storages``,
    ``HeuristicalStorageReservation``), so a smaller batch may fit where this one does not. Its
    placement may change with the batch too, so the question is asked of the planner itself, by
    bisection (a batch that fits taken to mean that every smaller one does: the estimates only
    grow with it).
    """

    def fits(batch_size: int) -> bool:
        smaller = cfg.replace(batch_size=batch_size)
        return _plan_within(app, smaller, model, sharders, topology, _PlannerReport())[0] is not None

    if not fits(1):
        return 0
    fitting, too_big = 1, cfg.training.batch_size
    while too_big - fitting > 1:
        middle = (fitting + too_big) // 2
        fitting, too_big = (middle, too_big) if fits(middle) else (fitting, middle)
    return fitting


def _plan_within(
    app: TrainingApp[C], cfg: C, model: nn.Module, sharders: list[Sharder], topology: Topology, report: _PlannerReport
) -> tuple[ShardingPlan | None, str]:
    """TorchRec's plan within ``topology``'s memory, or None and the planner's reason where no
    placement fits there; any other failure of the planner is a ConfigError."""
    try:
        return _offline_plan(app, cfg, model, sharders, topology, report), ""
    except PlannerError as e:
        if e.error_type != PlannerErrorType.INSUFFICIENT_STORAGE:
            raise ConfigError(f"TorchRec's planner found no plan: {_first_line(e)}") from None
        return None, _first_line(e)


def _topology(cluster: Cluster, unlimited: bool = False) -> Topology:
    hbm = UNLIMITED if unlimited and cluster.device == "cuda" else cluster.hbm_per_rank
    ddr = UNLIMITED if unlimited else cluster.ddr_per_rank
    return make_topology(cluster.world_size, cluster.nproc_per_node, cluster.device, hbm, ddr)


def _offline_plan(
    app: TrainingApp[C],
    cfg: C,
    model: nn.Module,
    sharders: list[Sharder],
    topology: Topology,
    report: _PlannerReport,
) -> ShardingPlan:
    """TorchRec's planner without a process group: ``plan`` where the app calls ``collective_plan``."""
    with _quiet_planner():
        return make_planner(app, cfg, model, topology, stats=[report]).plan(model, sharders)


@contextlib.contextmanager
def _quiet_planner() -> Iterator[None]:
    """Silences the planner's log lines that do not apply to a preview, such as that data-parallel
    tables have no sharding spec (they never do)."""
    root = logging.getLogger()  # TorchRec logs some of them through the root logger itself
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].strip()


def _gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def _peak(used: list[int], has: int, kind: str) -> str:
    rank = max(range(len(used)), key=used.__getitem__)
    return f"{_gib(used[rank])} of {_gib(has)} {kind} (rank {rank})"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def main(app: AppSpec, argv: list[str] | None = None) -> None:
    """The command ``python -m apps.<app>.plan``: the preview of the app's job whose options its
    PlanConfig offers, by the TrainingApp the app gives for them (its tables may depend on the
    options: managed-collision ones with --categorical_ids zch)."""
    parser = build_parser(
        PlanTarget,
        prog=f"python -m {app.module('plan')}",
        description="Preview TorchRec's sharding plan and each rank's memory for a training job "
        f"(the same -j/-h and model options as components.{app.name}:train), on any machine, and say "
        f"whether it fits. Exits {DOES_NOT_FIT} if it does not (2: a bad option). Options of the "
        "training job that the plan does not depend on are not taken.",
    )
    parser.epilog = (
        "--hbm_gb 0 plans with the HBM of the GPU of the -h instance type, known for: " + ", ".join(GPU_HBM_GIB) + "."
    )
    add_options(parser, app.plan_config)
    parsed, unknown = parser.parse_known_args(argv)
    args = vars(parsed)
    try:
        if unknown:
            raise ConfigError(
                f"{' '.join(unknown)}: not an option of the plan, which takes -j, -h and the options "
                "that change where the tables go (training-only ones do not; drop them): see --help"
            )
        target_names = {field.name for field in options_of(PlanTarget)}
        target_args = {name: args.pop(name) for name in target_names & set(args)}
        cfg = cast(SharedSections, app.plan_config.from_options(args))  # the app's PlanConfig: a JobConfig
        # The job's --hbm_gb, which its training app plans with too (apps/core/training/sharding.py).
        target = PlanTarget(**target_args, hbm_gb=cfg.launch.hbm_gb)
        result = preview(app.training().app_for(cfg), cfg, target.cluster)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)  # a value's fault: no usage dump
        sys.exit(2)
    print(result.render())
    sys.exit(0 if result.fits else DOES_NOT_FIT)
