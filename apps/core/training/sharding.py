"""How an app's embedding tables are split across ranks: sharder, sharding plan, and the DMP wrap.

The tables are the app's TorchRec ``EmbeddingBagCollection`` or ``EmbeddingCollection``, or
several collections side by side (:class:`~apps.core.common.tables.Tables`), each with its sharder;
everything else is the same for all."""

import logging
import re
import warnings
from collections import Counter
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embedding_modules import BaseManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import (
    HeuristicalStorageReservation,
    _get_dense_tensor_size,
)
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    Stats,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from apps.core.common.distributed import DistEnv
from apps.core.common.errors import ConfigError
from apps.core.common.tables import TableModule, Tables
from apps.core.config import LaunchConfig, SharedSections, check_int8_comms
from apps.core.training.app import C, TrainingApp
from apps.core.training.optim import fuse_embedding_optimizer
from apps.core.zch.config import check_world_size
from apps.core.zch.modules import reset_rows_on_host

logger = logging.getLogger(__name__)

GiB = 1024**3

#: TorchRec's default storage reservation (torchrec 1.8.0), made explicit with its own values so
#: plans do not change: each rank keeps 15% of its memory free, and room for the dense part
#: (its parameters times 6: weights, optimizer state and DDP's buckets) and the input features.
RESERVE_PERCENTAGE = 0.15
DENSE_MULTIPLIER = 6.0

_COMM_TYPES = {
    "fp32": CommType.FP32,
    "fp16": CommType.FP16,
    "bf16": CommType.BF16,
    "int8": CommType.INT8,
    "fp8": CommType.FP8,
}


#: TorchRec's sharder of either kind of table collection (or of managed-collision tables).
Sharder: TypeAlias = (
    EmbeddingBagCollectionSharder
    | EmbeddingCollectionSharder
    | ManagedCollisionEmbeddingBagCollectionSharder
    | ManagedCollisionEmbeddingCollectionSharder
)


def model_to_shard(app: TrainingApp[C], cfg: C, dense_device: torch.device) -> tuple[nn.Module, list[Sharder]]:
    """The app's unsharded model (tables on the meta device, optimizer fused) and the sharders of
    its table collections.

    What the training app shards and what the plan preview plans for: one recipe, so the
    preview's planner sees the tables and storage the job will have.
    """
    model = app.build_model(cfg, dense_device)
    for path in app.tables.paths:
        fuse_embedding_optimizer(cfg.training, model.get_submodule(path).parameters())
    return model, make_sharders(cfg.launch, app.tables)


def make_sharders(cfg: LaunchConfig, tables: Tables) -> list[Sharder]:
    """TorchRec's sharder of each kind of collection ``tables`` has, with quantized all-to-all
    comms when asked for."""
    forward = _COMM_TYPES[cfg.qcomm_forward_precision]
    backward = _COMM_TYPES[cfg.qcomm_backward_precision]
    registry = None
    if (forward, backward) != (CommType.FP32, CommType.FP32):
        registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=forward, backward_precision=backward))
    return [_sharder(module, registry) for module in tables.modules]


def _sharder(tables: TableModule, registry: dict[str, Any] | None) -> Sharder:
    """TorchRec's sharder of a collection of ``tables``' kind."""
    if tables.managed and tables.pooled:  # TorchRec's sharder of the tables in its sharder of their id maps
        bags = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
        return ManagedCollisionEmbeddingBagCollectionSharder(bags, qcomm_codecs_registry=registry)
    if tables.managed:
        sequences = EmbeddingCollectionSharder(qcomm_codecs_registry=registry)
        return ManagedCollisionEmbeddingCollectionSharder(sequences, qcomm_codecs_registry=registry)
    if tables.pooled:
        return EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    return EmbeddingCollectionSharder(qcomm_codecs_registry=registry)


def make_topology(
    world_size: int,
    local_world_size: int,
    compute_device: str,
    hbm_cap_bytes: int | None = None,
    ddr_cap_bytes: int | None = None,
) -> Topology:
    """The planner's view of the cluster: ranks, ranks per node, device and memory per rank."""
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        hardware_config=HardwareConfig(hbm_cap_bytes=hbm_cap_bytes, ddr_cap_bytes=ddr_cap_bytes),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


def training_topology(cfg: SharedSections, env: DistEnv, gpu_bytes: int = 0) -> Topology:
    """The topology the training app plans with: its world, and on GPUs each rank's HBM.

    ``gpu_bytes`` is the memory of this rank's GPU (unused on CPU ranks). A pure function of
    its arguments, so that a test without a GPU plans exactly what a GPU job plans, and so the
    plan preview (the app's plan.py) and the job agree on the HBM per rank: --hbm_gb when set.
    """
    device_type = env.device.type
    hbm = hbm_per_rank(cfg.launch, gpu_bytes) if device_type == "cuda" else None
    return make_topology(env.world_size, env.local_world_size, device_type, hbm)


def hbm_per_rank(cfg: LaunchConfig, gpu_bytes: int) -> int:
    """Bytes of HBM the planner may place tables in: --hbm_gb GiB, or 0 for the whole GPU.

    Less than the GPU has is how a user makes the planner cache tables from host memory
    (fused_uvm_caching); more is refused, as the planner would place tables in memory that is
    not there and the job would fail with CUDA out-of-memory errors later.
    """
    if not cfg.hbm_gb:
        return gpu_bytes
    hbm = int(cfg.hbm_gb * GiB)
    if hbm > gpu_bytes:
        raise ConfigError(
            f"--hbm_gb {cfg.hbm_gb:g} is more than this GPU's {gpu_bytes / GiB:.2f} GiB: give at "
            "most that, or 0 to plan with the whole GPU"
        )
    return hbm


def storage_reservation(model: nn.Module, tables: Tables) -> HeuristicalStorageReservation:
    """The memory TorchRec's planner keeps free on each rank: its default, given explicitly.

    With the dense part's size given (the one TorchRec computes itself), the planner no longer
    warns that its computation may be off in a dry run: the plan preview's meta tensors have
    their real shapes, so it is not.
    """
    collections = {model.get_submodule(path) for path in tables.paths}
    dense = _get_dense_tensor_size(model, collections, DENSE_MULTIPLIER)
    with warnings.catch_warnings():
        # Its constructor warns on every use that the policy is "over-tuned"; TorchRec's planner
        # uses it by default all the same, and this project's plans are made with it.
        warnings.filterwarnings("ignore", message="HeuristicalStorageReservation is known", category=FutureWarning)
        return HeuristicalStorageReservation(
            percentage=RESERVE_PERCENTAGE,
            parameter_multiplier=DENSE_MULTIPLIER,
            dense_tensor_estimate=dense,
        )


def make_planner(
    app: TrainingApp[C], cfg: C, model: nn.Module, topology: Topology, stats: list[Stats] | None = None
) -> EmbeddingShardingPlanner:
    """TorchRec's planner for ``model``; an explicit --sharding_type becomes a constraint on every table.

    ``stats`` replace TorchRec's default report: the planner hands its chosen placement, with
    per-shard storage estimates, only to them (the plan preview reads it there).
    """
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=cfg.training.batch_size,
        storage_reservation=storage_reservation(model, app.tables),
        constraints=table_constraints(app, cfg, model),
        stats=stats,
    )


def table_constraints(app: TrainingApp[C], cfg: C, model: nn.Module) -> dict[str, ParameterConstraints] | None:
    """Per table, what the planner must respect: an explicit --sharding_type (the plain tables'
    where managed-collision ones sit beside them: those are row-wise, the one type their sharder
    offers), and the ids per sample (its pooling factor) where the app says they are not one, which
    its estimates of input size, comms and compute scale with (TorchRec assumes one otherwise)."""
    pooling_factors = app.pooling_factors(cfg)
    mixed = len(app.tables.modules) > 1
    constraints = {}
    for table in table_names(model, app.tables):
        kwargs: dict[str, list[str] | list[float]] = {}
        if cfg.launch.sharding_type != "auto" and not (mixed and app.tables.module_of(table).managed):
            kwargs["sharding_types"] = [cfg.launch.sharding_type]
        if table in pooling_factors:
            kwargs["pooling_factors"] = [pooling_factors[table]]
        if kwargs:
            constraints[table] = ParameterConstraints(**kwargs)
    return constraints or None


def table_names(model: nn.Module, tables: Tables | TableModule) -> list[str]:
    """The names of the tables of ``model``'s table collections, in their order."""
    return [config.name for config in table_configs(model, tables)]


def table_configs(model: nn.Module, tables: Tables | TableModule) -> list[BaseEmbeddingConfig]:
    """The configs of the tables of ``model``'s table collections (or of one), in their order."""
    if isinstance(tables, Tables):
        return [config for module in tables.modules for config in table_configs(model, module)]
    collection: Any = model.get_submodule(tables.path)
    if tables.managed:  # TorchRec's managed-collision module: the collection it wraps
        collection = collection._embedding_module
    return collection.embedding_bag_configs() if tables.pooled else collection.embedding_configs()


def planner_offers(cfg: LaunchConfig, sharders: list[Sharder], device_type: str) -> bool:
    """Whether TorchRec's planner places every collection's tables: each sharder offers the
    sharding type asked for, or any for ``auto`` (managed-collision tables beside plain ones: any,
    they are row-wise whatever the plain ones are). Not managed-collision tables on CPUs: the
    sharder of bags offers none there, and that of sequences offers row-wise with GPU kernels only
    (fused_uvm...), which the planner's estimators refuse on a CPU; their row-wise plan is built
    directly."""
    mixed = len(sharders) > 1
    for sharder in sharders:
        managed = isinstance(sharder, BaseManagedCollisionEmbeddingCollectionSharder)
        if device_type == "cpu" and managed:
            return False
        offered = sharder.sharding_types(device_type)
        wanted = "auto" if managed and mixed else cfg.sharding_type
        if not (wanted in offered or (wanted == "auto" and bool(offered))):
            return False
    return True


def build_plan(
    app: TrainingApp[C],
    cfg: C,
    model: nn.Module,
    sharders: list[Sharder],
    env: DistEnv,
) -> ShardingPlan:
    """The sharding plan for this world, identical on every rank.

    TorchRec's planner places the tables for ``auto`` and for every sharding type it offers on
    this device. On CPUs it offers no row-wise kinds, so those plans are built directly.
    """
    managed = [module for module in app.tables.modules if module.managed]
    if managed:
        sizes = {config.name: config.num_embeddings for module in managed for config in table_configs(model, module)}
        check_world_size(sizes, env.world_size)
    plan = _rank_plan(app, cfg, model, sharders, env)
    check_int8_comms(cfg.launch, [s["type"] for s in plan_tables(plan).values()])
    return plan


def _rank_plan(
    app: TrainingApp[C],
    cfg: C,
    model: nn.Module,
    sharders: list[Sharder],
    env: DistEnv,
) -> ShardingPlan:
    """Collective. The planner's plan of every collection, agreed by every rank; where it cannot
    place them all, each collection's own: the planner's where it offers the sharding type, else
    the row-wise plan built directly."""
    if planner_offers(cfg.launch, sharders, env.device.type):
        return _planned(app, cfg, model, model, sharders, env)
    plans: dict[str, Any] = {}
    for module, sharder in zip(app.tables.modules, sharders):
        collection = model.get_submodule(module.path)
        if planner_offers(cfg.launch, [sharder], env.device.type) and not module.managed:
            plans[module.path] = _planned(app, cfg, model, collection, [sharder], env).plan[""]
        else:
            plans[module.path] = _direct_plan(cfg.launch, collection, table_names(model, module), sharder, env)
    return ShardingPlan(plans)


def _planned(
    app: TrainingApp[C], cfg: C, model: nn.Module, module: nn.Module, sharders: list[Sharder], env: DistEnv
) -> ShardingPlan:
    """Collective. TorchRec's plan of the collections in ``module`` (``model`` or one of its table
    collections, then keyed ``""``), agreed by every rank; ``model`` sizes the dense part."""
    gpu_bytes = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else 0
    topology = training_topology(cfg, env, gpu_bytes)
    return make_planner(app, cfg, model, topology).collective_plan(module, sharders, dist.group.WORLD)


def _direct_plan(cfg: LaunchConfig, collection: nn.Module, names: list[str], sharder: Sharder, env: DistEnv) -> Any:
    """The row-wise plan of ``collection``'s tables ``names`` (table_row_wise with that option),
    built without the planner: what CPUs shard row-wise and managed-collision tables with."""
    if cfg.sharding_type == "table_row_wise" and not isinstance(
        sharder, BaseManagedCollisionEmbeddingCollectionSharder
    ):  # each table row-wise inside one node, tables spread over nodes
        per_table = {table: table_row_wise(host_index=i % env.num_nodes) for i, table in enumerate(names)}
    else:  # row_wise, or auto of managed-collision tables (row-wise only)
        per_table = {table: row_wise() for table in names}
    return construct_module_sharding_plan(
        collection,
        per_table,
        sharder=sharder,
        local_size=env.local_world_size,
        world_size=env.world_size,
        device_type=env.device.type,
    )


def shard_model(
    model: nn.Module,
    plan: ShardingPlan,
    sharders: list[Sharder],
    env: DistEnv,
    data_parallel: bool = True,
) -> DistributedModelParallel:
    """Wraps the model in DMP: tables sharded by ``plan``, the dense part (and data-parallel
    tables) replicated with DDP, unless ``data_parallel`` is False (one rank: nothing to
    all-reduce). The state dict is the same either way."""
    sharded = DistributedModelParallel(
        module=model, device=env.device, plan=plan, sharders=list(sharders), init_data_parallel=data_parallel
    )
    if any(isinstance(sharder, BaseManagedCollisionEmbeddingCollectionSharder) for sharder in sharders):
        reset_rows_on_host(sharded)
    return sharded


def plan_tables(plan: ShardingPlan) -> dict[str, dict]:
    """Per table (of every table module the plan shards), in natural order of their names
    (t_cat_2 before t_cat_10): sharding type, compute kernel and the ranks holding shards."""
    tables = sorted(
        ((table, s) for module in plan.plan.values() for table, s in module.items()),
        key=lambda kv: _natural_key(kv[0]),
    )
    return {
        table: {"type": s.sharding_type, "kernel": s.compute_kernel, "ranks": list(s.ranks or [])}
        for table, s in tables
    }


def describe_plan(plan: ShardingPlan) -> str:
    """One line per table: sharding type, compute kernel and ranks."""
    return "\n".join(
        f"{table}: {s['type']} ({s['kernel']}) on ranks {','.join(map(str, s['ranks'])) or '-'}"
        for table, s in plan_tables(plan).items()
    )


def summarize_plan(plan: ShardingPlan, world_size: int) -> str:
    """The plan in a few words, for a log line: its tables by sharding type, and how many tables
    each rank holds shards of (``26 tables (26 table_wise) on 2 ranks, 13 per rank``)."""
    tables = plan_tables(plan).values()
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(s["type"] for s in tables).most_common())
    held = Counter(rank for s in tables for rank in s["ranks"])
    fewest, most = min(held[r] for r in range(world_size)), max(held[r] for r in range(world_size))
    per_rank = str(most) if fewest == most else f"{fewest} to {most}"
    ranks = f"{world_size} rank" + ("s" if world_size != 1 else "")
    return f"{len(tables)} tables ({kinds}) on {ranks}, {per_rank} per rank"


def _natural_key(name: str) -> list[str | int]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
