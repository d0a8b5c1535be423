"""The DLRM: TorchRec's ``DLRM`` family with one embedding table per sparse feature."""

import functools
from typing import Callable, List, Optional, ParamSpec, Sequence, TypeVar

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain, SparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from apps.core.common.compile_cache import key_compile_cache_by_cpu
from apps.core.common.tables import TableModule, Tables
from apps.core.config import LaunchConfig
from apps.core.zch.config import ZchConfig
from apps.core.zch.modules import managed_collisions
from apps.dlrm.config import ModelConfig
from apps.dlrm.data.criteo.tables import feature_names

#: Where the tables live inside ``DLRMTrain``: the key of the module in a sharding plan.
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
#: ... and what they are, for the shared machinery that plans, shards and checkpoints them.
TABLES = Tables.of(EBC_PATH, "EmbeddingBagCollection")
#: ... with --categorical_ids zch: the same tables, each with its managed-collision id-to-row map.
MANAGED_TABLES = Tables.of(EBC_PATH, "ManagedCollisionEmbeddingBagCollection")
#: With --zch_columns: where the managed-collision tables are, beside the plain ones (at EBC_PATH).
MC_EBC_PATH = "model.sparse_arch.managed_collection"


def mixed_tables(managed: Sequence[str]) -> Tables:
    """The tables of a DLRM whose tables ``managed`` (names) are managed-collision ones, the others
    plain (--zch_columns): two TorchRec collections, as TorchRec manages all of one's tables or none."""
    return Tables(
        (
            TableModule(EBC_PATH, "EmbeddingBagCollection"),
            TableModule(MC_EBC_PATH, "ManagedCollisionEmbeddingBagCollection", frozenset(managed)),
        )
    )


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    """One table per feature; a feature's ids in a sample are pooled by ``--pooling``."""
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
            pooling=PoolingType[cfg.pooling.upper()],
        )
        for name, rows in zip(feature_names(cfg.num_sparse_features), cfg.table_sizes)
    ]


def build_model(
    cfg: ModelConfig,
    dense_device: torch.device,
    table_device: torch.device | None = None,
    zch: ZchConfig | None = None,
    managed: Sequence[int] | None = None,
) -> DLRMTrain:
    """The training module (model + BCE loss); with ``zch``, its tables managed-collision ones
    (:data:`MANAGED_TABLES`, apps/core/zch/), or those of the features ``managed`` (0-based) where
    it names some only, beside the plain others (:func:`mixed_tables`).

    Tables are built on the meta device by default so that no rank ever allocates a whole
    table: ``DistributedModelParallel`` materialises only each rank's shards. The dense part is
    built on ``dense_device`` with the current RNG state (seed it for identical ranks).
    """
    table_device = table_device or torch.device("meta")
    configs = table_configs(cfg)
    chosen = set() if zch is None else set(range(len(configs)) if managed is None else managed)
    mixed = 0 < len(chosen) < len(configs)
    # A mixed model's tables are its two collections: this one only tells TorchRec's DLRM the
    # features and their width, so it allocates nothing (on a CPU, export would hold every table twice).
    tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta") if mixed else table_device)
    common = dict(
        embedding_bag_collection=tables,
        dense_in_features=cfg.num_dense_features,
        dense_arch_layer_sizes=cfg.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.over_arch_layer_sizes,
        dense_device=dense_device,
    )
    if cfg.interaction_type == "dcn":
        model = DLRM_DCN(
            **common,
            dcn_num_layers=cfg.dcn_num_layers,
            dcn_low_rank_dim=cfg.dcn_low_rank_dim,
        )
    elif cfg.interaction_type == "projection":
        model = DLRM_Projection(
            **common,
            interaction_branch1_layer_sizes=cfg.interaction_branch1_layer_sizes,
            interaction_branch2_layer_sizes=cfg.interaction_branch2_layer_sizes,
        )
    else:
        model = DLRM(**common)
    if zch is None or not chosen:
        model.sparse_arch = PooledSparseArch(tables)
    elif not mixed:
        model.sparse_arch = ManagedSparseArch(_managed(tables, zch, table_device))
    else:
        plain = EmbeddingBagCollection([c for k, c in enumerate(configs) if k not in chosen], device=table_device)
        beside = EmbeddingBagCollection([c for k, c in enumerate(configs) if k in chosen], device=table_device)
        model.sparse_arch = MixedSparseArch(tables, plain, _managed(beside, zch, table_device))
    return DLRMTrain(model)


def _managed(
    tables: EmbeddingBagCollection, zch: ZchConfig, device: torch.device
) -> ManagedCollisionEmbeddingBagCollection:
    """``tables``, each with its managed-collision id-to-row map."""
    return ManagedCollisionEmbeddingBagCollection(
        tables, managed_collisions(tables.embedding_bag_configs(), zch, device)
    )


class PooledSparseArch(SparseArch):
    """TorchRec's ``SparseArch`` (same submodule, same state dict), its output [batch, features,
    dim] read from the pooled ``KeyedTensor``'s values, without its copy.

    TorchRec's splits the values into a tensor per feature (``to_dict``), then concatenates them
    in feature order: on one rank (the lean step, or an unsharded model) the tables' keys already
    are in that order, all of one dim, so the values are the output as they are, viewed
    [batch, features, dim]; sharded, in the order the shards' lookups take them, they are one
    gather of the features' columns. The numbers are the same: both only move them.
    """

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return _in_feature_order(self.embedding_bag_collection(features), self.sparse_feature_names, self.D)


class ManagedSparseArch(PooledSparseArch):
    """:class:`PooledSparseArch` of managed-collision tables: TorchRec's module maps the ids to
    rows before its tables look them up, and returns the pooled embeddings first of a pair."""

    def __init__(self, tables: ManagedCollisionEmbeddingBagCollection) -> None:
        super().__init__(tables._embedding_bag_collection)  # the tables' configs: features, width
        self.embedding_bag_collection = tables

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.embedding_bag_collection(features)
        return _in_feature_order(pooled, self.sparse_feature_names, self.D)


class MixedSparseArch(PooledSparseArch):
    """:class:`PooledSparseArch` of plain tables beside managed-collision ones (--zch_columns): each
    collection looks up its own features of the batch (its lookups take only those), and their
    pooled embeddings are joined in the order of every feature, as one collection's would be."""

    def __init__(
        self,
        every: EmbeddingBagCollection,
        plain: EmbeddingBagCollection,
        managed: ManagedCollisionEmbeddingBagCollection,
    ) -> None:
        super().__init__(every)  # every table's configs: features, width
        self.embedding_bag_collection = plain
        self.managed_collection = managed

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        managed, _ = self.managed_collection(features)
        return _joined_in_feature_order(
            self.embedding_bag_collection(features), managed, self.sparse_feature_names, self.D
        )


@torch.fx.wrap  # one call in the symbolic traces of TorchRec's train pipelines, which look at no key
def _joined_in_feature_order(plain: KeyedTensor, managed: KeyedTensor, names: List[str], dim: int) -> torch.Tensor:
    """Two collections' pooled embeddings as [batch, features, dim], the features in the order of ``names``."""
    return KeyedTensor.regroup([plain, managed], [names])[0].view(-1, len(names), dim)


@torch.fx.wrap  # one call in the symbolic traces of TorchRec's train pipelines, which look at no key
def _in_feature_order(pooled: KeyedTensor, names: List[str], dim: int) -> torch.Tensor:
    """``pooled``'s values as [batch, features, dim], the features in the order of ``names``.

    TorchScript (TorchRec's inference format: ``torch.jit.script`` of the traced model) compiles
    its own branch, without the cache, whose keys it cannot type."""
    by_key = pooled.values().view(-1, len(names), dim)
    if torch.jit.is_scripting():
        keys = pooled.keys()
        if keys == names:
            return by_key
        return by_key.index_select(1, torch.tensor([keys.index(name) for name in names], device=by_key.device))
    order = _cached_order(pooled, names, dim, by_key.device)
    return by_key if order is None else by_key.index_select(1, order)


@torch.jit.unused
def _cached_order(pooled: KeyedTensor, names: List[str], dim: int, device: torch.device) -> Optional[torch.Tensor]:
    return _feature_order(tuple(pooled.keys()), tuple(names), tuple(pooled.length_per_key()), dim, device)


@functools.lru_cache(maxsize=16)
def _feature_order(
    keys: tuple[str, ...], names: tuple[str, ...], dims: tuple[int, ...], dim: int, device: torch.device
) -> torch.Tensor | None:
    """Where each of ``names`` is among ``keys`` (None: each in its place), found once for a
    run's order of keys."""
    if sorted(keys) != sorted(names) or set(dims) != {dim}:
        raise ValueError(f"pooled embeddings {keys} of widths {dims}: expected {names}, each {dim} wide")
    indices = [keys.index(name) for name in names]
    return None if indices == list(range(len(names))) else torch.tensor(indices, device=device)


#: The dense part of TorchRec's DLRM models: bottom MLP, interaction and top MLP.
DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")


def speed_up_dense(cfg: LaunchConfig, model: DLRMTrain, device: torch.device) -> None:
    """Applies --dense_precision and --compile_dense to the dense part, in place.

    Each part keeps its module and parameter names (its ``forward`` is wrapped, and
    ``nn.Module.compile`` compiles in place), so checkpoints and sharding plans are the same
    with or without. Outputs stay float32, as the loss and the next part expect.

    Compiled, each forward of ``model`` (a training step, or an evaluation batch) is one
    iteration of torch's CUDA graph trees (:func:`_one_iteration`); evaluation, under
    ``no_grad``, gets graphs of its own (torch.compile guards on the grad mode and compiles it
    apart). The same path runs in every compile mode, so that CPU runs cover it.
    """
    for name in DENSE_PARTS:
        part = getattr(model.model, name)
        if cfg.dense_precision == "bf16":
            part.forward = _in_bf16(part.forward, device.type)
        if cfg.compile_dense != "none":
            key_compile_cache_by_cpu()
            part.compile(mode=cfg.compile_dense)
    if cfg.compile_dense != "none":
        model.forward = _one_iteration(model.forward)


P = ParamSpec("P")
R = TypeVar("R")


def _in_bf16(forward: Callable[P, torch.Tensor], device_type: str) -> Callable[P, torch.Tensor]:
    @functools.wraps(forward)
    def bf16_forward(*args: P.args, **kwargs: P.kwargs) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs).float()

    return bf16_forward


def _one_iteration(forward: Callable[P, R]) -> Callable[P, R]:
    """``forward``, marking a new iteration of CUDA graph trees first (a no-op without them).

    Without marks, CUDA graph trees (--compile_dense reduce-overhead) start an iteration, and
    free the last one's outputs for the next replay to overwrite, at each call of a compiled
    function when no backward is pending: in evaluation, at each of the three parts, so the
    interaction read the bottom MLP's overwritten output ("accessing tensor output of
    CUDAGraphs that has been overwritten by a subsequent run", at the first validation on an
    H200). Once marked, only the marks start iterations: one per training step or evaluation
    batch, as ``torch.compiler.cudagraph_mark_step_begin`` documents. An iteration's outputs
    then live until the next one's: who keeps them longer clones them (``eval_outputs``).
    """

    @functools.wraps(forward)
    def marked(*args: P.args, **kwargs: P.kwargs) -> R:
        torch.compiler.cudagraph_mark_step_begin()
        return forward(*args, **kwargs)

    return marked
