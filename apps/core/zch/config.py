"""The options and checks of managed-collision tables (``--categorical_ids zch``): what the
command line, the TorchX components and the data readers need, without torch (a submission imports
it). What zch tables are: :mod:`apps.core.zch`; TorchRec's modules: :mod:`apps.core.zch.modules`."""

from dataclasses import dataclass, fields
from typing import Mapping, Protocol, Sequence

from apps.core.common.errors import ConfigError
from apps.core.config import CheckpointConfig, LaunchConfig, require_positive
from apps.core.options import option

#: The --categorical_ids choice that makes every table a managed-collision table.
ZCH = "zch"
#: The range the ids fed to TorchRec's module lie in: its default ``input_hash_size``, the most an
#: int64 holds less one (TorchRec marks an empty slot with the int64 maximum itself).
INPUT_HASH_SIZE = 2**63 - 1
#: TorchRec's eviction policies (apps/core/zch/modules.py: their classes), by --zch_eviction_policy.
EVICTION_POLICY_NAMES = ("lfu", "lru", "distance_lfu")
#: What TorchRec's sharder of managed-collision tables offers (its ManagedCollisionCollectionSharder).
SHARDING_TYPES = ("row_wise",)
#: Rows each rank's share of a table needs: TorchRec keeps its last for the ids without a row, so
#: an id of its own needs one more.
MIN_ROWS_PER_RANK = 2
#: What an unsharded MCH module tells TorchRec's planner it splits into (its ``buckets``). The
#: planner of torchrec 1.8 refuses a module whose buckets the world size does not divide (1.6.1 does
#: not ask); sharding rebuilds each rank's module with its own, so this number is read by the
#: planner only: the least common multiple of 1 to 16 times 256, which every world size of up to 16
#: ranks, and those times a power of two up to 256, divides.
PLANNER_BUCKETS = 720_720 * 256


@dataclass(slots=True)
class ZchConfig:
    """How managed-collision tables (``--categorical_ids zch``) give rows to ids."""

    zch_eviction_policy: str = option(
        "lfu",
        "--categorical_ids zch: which ids keep their rows when new ones come (TorchRec's MCH eviction "
        "policies). lfu: the most seen since they got a row; lru: the most recently seen; "
        "distance_lfu: counts divided by the steps since last seen (for ids whose popularity drifts).",
        choices=EVICTION_POLICY_NAMES,
    )
    zch_eviction_interval: int = option(
        1,
        "--categorical_ids zch: training steps between two evictions, when the ids counted since "
        "the last take rows. Longer counts rare ids more fairly but leaves new ids on the shared "
        "row longer; --checkpoint_every must be a multiple (the counts between two evictions are "
        "not part of TorchRec's saved state, so a checkpoint must fall right after one).",
    )

    def check(self) -> None:
        require_positive("zch_eviction_interval", self.zch_eviction_interval)


class _IdsSection(Protocol):
    categorical_ids: str


class _ZchJob(Protocol):
    """An app's configuration that offers --categorical_ids zch: its data section says which ids."""

    @property
    def data(self) -> _IdsSection: ...

    @property
    def zch(self) -> ZchConfig: ...


def zch_of(cfg: _ZchJob) -> ZchConfig | None:
    """The managed-collision tables' options where ``cfg`` has them (--categorical_ids zch)."""
    return cfg.zch if cfg.data.categorical_ids == ZCH else None


def check_zch(
    cfg: ZchConfig,
    table_sizes: Sequence[int] | Mapping[int, int],
    launch: LaunchConfig,
    checkpoint: CheckpointConfig,
    rows_option: str = "--num_embeddings",
    beside_plain: bool = False,
) -> None:
    """Refuses, naming the option, what managed-collision tables cannot train with: tables too
    small for TorchRec's module (their rows given by ``rows_option``; ``table_sizes`` by the tables'
    numbers where only some are managed), a sharding type its sharder
    does not offer (unless they sit ``beside_plain`` tables, whose sharding type it is then: they
    are row-wise whatever it is), checkpoints that would not fall right after an eviction."""
    cfg.check()
    sizes = table_sizes.items() if isinstance(table_sizes, Mapping) else enumerate(table_sizes)
    for i, rows in sizes:
        if rows < MIN_ROWS_PER_RANK:
            raise ConfigError(
                f"{rows_option} {rows} (table {i}) is too small for --categorical_ids zch: TorchRec's "
                f"managed-collision table keeps its last row for ids without one, so it needs at least "
                f"{MIN_ROWS_PER_RANK} rows per rank"
            )
    if launch.sharding_type not in ("auto", *SHARDING_TYPES) and not beside_plain:
        raise ConfigError(
            f"--sharding_type {launch.sharding_type}: TorchRec shards managed-collision tables "
            f"(--categorical_ids zch) {' or '.join(SHARDING_TYPES)} only; use --sharding_type "
            f"{SHARDING_TYPES[0]} or auto"
        )
    every, interval = checkpoint.checkpoint_every, cfg.zch_eviction_interval
    if checkpoint.checkpoint_dir and every % interval:
        raise ConfigError(
            f"--checkpoint_every {every} is not a multiple of --zch_eviction_interval {interval}: a "
            "checkpoint must fall right after an eviction (TorchRec saves no ids counted since the "
            "last), so that a resumed run trains as an uninterrupted one"
        )


def check_world_size(tables: Mapping[str, int], world_size: int, rows_option: str = "rows") -> None:
    """Refuses a world whose row-wise shares (TorchRec's: ceil(rows / ranks) each, the last rank
    the rest) leave a rank fewer rows than a managed-collision share needs, or that TorchRec's
    planner cannot split the modules over (:data:`PLANNER_BUCKETS`). ``tables``: each managed
    table's rows by its name; ``rows_option``: what sizes them, for the message."""
    if PLANNER_BUCKETS % world_size:
        raise ConfigError(
            f"{world_size} ranks: TorchRec's planner splits managed-collision tables (--categorical_ids zch) "
            f"over world sizes that divide {PLANNER_BUCKETS:,} (up to 16 ranks, and those times a power of "
            "two up to 256); use such a number of ranks"
        )
    for name, rows in tables.items():
        share = -(-rows // world_size)
        last = rows - share * (world_size - 1)
        if min(share, last) < MIN_ROWS_PER_RANK:
            raise ConfigError(
                f"{rows_option} {rows} (table {name}) on {world_size} ranks leaves a rank {min(share, last)} "
                f"rows: a managed-collision table (--categorical_ids zch) needs {MIN_ROWS_PER_RANK} per rank; "
                f"give at least {MIN_ROWS_PER_RANK * world_size} rows, or fewer ranks"
            )


def check_options_used(cfg: ZchConfig, has_managed_tables: bool, how: str = f"--categorical_ids {ZCH}") -> None:
    """Refuses managed-collision options changed from their defaults in a job without
    managed-collision tables (``how`` says what gives it some), where they would change nothing."""
    if has_managed_tables:
        return
    for field in fields(ZchConfig):
        value = getattr(cfg, field.name)
        if value != field.default:
            raise ConfigError(
                f"--{field.name} {value} applies to managed-collision tables only, and this job has none: "
                f"add {how}, or drop --{field.name}"
            )
