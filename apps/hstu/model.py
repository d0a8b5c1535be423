"""The HSTU model: item and action embeddings in one TorchRec ``EmbeddingCollection`` (unpooled:
one vector per event), a stack of HSTU layers over each user's events, and the objective.

A user's event ``t`` becomes the token

    item_emb(item_t) + action_emb(action_{t-1}) [+ position_emb(t)]

its item, and the action taken on the event before (a learned start vector for the first): the
token never holds its own action, so the output at ``t`` may predict both the next item
(retrieval) and the action taken on item ``t`` (ranking) without seeing the answer, and one
forward pass over a user's events trains every position at once.

With ``--categorical_ids zch`` the item table is TorchRec's managed-collision one
(``ManagedCollisionEmbeddingCollection``, apps/core/zch/), whose module maps the raw item ids of
every lookup (events, negatives, candidates) to rows, and the action table, a dozen ids known in
advance that need no id map, is a plain embedding of the dense part. Whatever compares items (the
accidental hits of the sampled softmax, the target among the candidates) compares their rows: two
ids without a row of their own share one, so their scores are one.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from apps.core.common.tables import Tables
from apps.core.zch.config import ZchConfig
from apps.core.zch.modules import held_ids, managed_collisions
from apps.hstu.config import HSTUModelConfig
from apps.hstu.data.batch import ACTION, ITEM, NEGATIVE, SequenceBatch, candidate_batch
from apps.hstu.modules.attention import attention_kernel
from apps.hstu.modules.jagged import JaggedLayout
from apps.hstu.modules.layer import HSTULayer

#: Where the tables live inside ``HSTUTrain``: the key of the module in a sharding plan.
TABLES_PATH = "model.embedding_collection"
#: ... and what they are, for the shared machinery that plans, shards and checkpoints them.
TABLES = Tables.of(TABLES_PATH, "EmbeddingCollection")
#: ... with --categorical_ids zch: the item table alone, with its managed-collision id-to-row map.
MANAGED_TABLES = Tables.of(TABLES_PATH, "ManagedCollisionEmbeddingCollection")


def table_configs(cfg: HSTUModelConfig, zch: bool = False) -> list[EmbeddingConfig]:
    """The item table (read by the events' items and by negatives/candidates) and, but with
    ``zch`` (whose actions are a dense embedding), the action table."""
    items = EmbeddingConfig(
        name="item_table", embedding_dim=cfg.embedding_dim, num_embeddings=cfg.num_items, feature_names=[ITEM, NEGATIVE]
    )
    if zch:
        return [items]
    actions = EmbeddingConfig(
        name="action_table", embedding_dim=cfg.embedding_dim, num_embeddings=cfg.num_actions, feature_names=[ACTION]
    )
    return [items, actions]


@dataclass
class Encoded:
    """The layer stack's output for a batch: one vector per event, and the item embeddings looked up."""

    outputs: torch.Tensor  # [total events, embedding_dim]
    layout: JaggedLayout
    items: torch.Tensor  # [total events] ids
    actions: torch.Tensor  # [total events] ids
    item_embeddings: torch.Tensor  # [total events, embedding_dim]
    negative_ids: torch.Tensor  # the batch's negative_item ids, jagged per user
    negatives: JaggedTensor  # their embeddings
    item_rows: torch.Tensor  # the rows of ``items``: what compares items (zch: remapped; else the ids)
    negative_rows: torch.Tensor  # ... of ``negative_ids``


@dataclass
class EvalOutput:
    """What the metrics need of an evaluation batch, whose users' last event is the target.

    Retrieval: ``ranks`` [users], the target item's rank among the candidates (1 = first).
    Ranking: ``action_logits`` and ``action_labels`` [users, num_actions] of the target event, and
    its item, ``target_items`` [users] (what the synthetic data's ceiling scores).
    """

    ranks: torch.Tensor | None = None
    action_logits: torch.Tensor | None = None
    action_labels: torch.Tensor | None = None
    target_items: torch.Tensor | None = None


class SequenceEncoder(nn.Module):
    """The dense part: tokens from the looked-up embeddings, the HSTU layers, the output norm.

    A module of its own, holding no table: TorchRec's train pipelines trace the model's forward
    down to the modules that hold a sharded table and call every other module as a whole, so
    the jagged, data-dependent work here stays out of that trace."""

    def __init__(self, cfg: HSTUModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = cfg.embedding_dim
        self.start_action = nn.Parameter(torch.zeros(dim, device=device))
        self.positions = nn.Embedding(cfg.max_seq_len, dim, device=device) if cfg.position_embedding else None
        kernel = attention_kernel(cfg.attention_kernel)
        self.layers = nn.ModuleList(
            HSTULayer(
                dim,
                cfg.num_heads,
                cfg.attention_dim,
                cfg.linear_dim,
                cfg.max_seq_len,
                cfg.num_time_buckets,
                cfg.dropout,
                kernel,
            ).to(device)
            for _ in range(cfg.num_layers)
        )
        self.output_norm = nn.LayerNorm(dim, device=device)

    def forward(self, looked_up: dict[str, JaggedTensor], batch: SequenceBatch, rows: KeyedJaggedTensor) -> Encoded:
        """``looked_up``'s embeddings of ``batch``'s features; ``rows``: the rows they were looked up
        at (the ids themselves; with a managed-collision table (zch), the ids it remapped)."""
        items, actions = looked_up[ITEM], looked_up[ACTION]
        layout = JaggedLayout.of(items.lengths())
        item_embeddings = items.values()
        tokens = item_embeddings + self._previous_actions(actions.values(), layout)
        if self.positions is not None:
            tokens = tokens + self.positions(layout.positions)
        for layer in self.layers:
            tokens = layer(tokens, batch.timestamps, layout)
        return Encoded(
            outputs=self.output_norm(tokens),
            layout=layout,
            items=batch.features[ITEM].values(),
            actions=batch.features[ACTION].values(),
            item_embeddings=item_embeddings,
            negative_ids=batch.features[NEGATIVE].values(),
            negatives=looked_up[NEGATIVE],
            item_rows=rows[ITEM].values(),
            negative_rows=rows[NEGATIVE].values(),
        )

    def _previous_actions(self, action_embeddings: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        """Each event's previous event's action embedding, the start vector for a user's first."""
        shifted = torch.cat([self.start_action[None], action_embeddings[:-1]])
        return torch.where(layout.first_tokens()[:, None], self.start_action[None], shifted)


def item_vectors(embeddings: torch.Tensor) -> torch.Tensor:
    """Item embeddings as the retrieval objective compares them: L2-normalised."""
    return F.normalize(embeddings, dim=-1)


class RetrievalLoss(nn.Module):
    """Sampled softmax of each event's next item against a pool shared by the batch: the random
    negatives of every user and the last next-item of every user (in-batch negatives); a pool
    item equal to the positive is masked out (an accidental hit). A module, so that train
    pipelines call it whole (see :class:`SequenceEncoder`)."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, encoded: Encoded) -> torch.Tensor:
        layout = encoded.layout
        has_next = layout.positions < (layout.lengths[layout.users] - 1)
        query_index = torch.nonzero(has_next).squeeze(1)
        queries = F.normalize(encoded.outputs[query_index], dim=-1)
        positive_ids = encoded.item_rows[query_index + 1]
        positives = item_vectors(encoded.item_embeddings[query_index + 1])
        last_next = layout.last_index()[layout.lengths > 1]
        pool_ids = torch.cat([encoded.negative_rows, encoded.item_rows[last_next]])
        pool = item_vectors(torch.cat([encoded.negatives.values(), encoded.item_embeddings[last_next]]))
        positive_logits = (queries * positives).sum(-1, keepdim=True)
        pool_logits = (queries @ pool.T).masked_fill(pool_ids[None, :] == positive_ids[:, None], float("-inf"))
        logits = torch.cat([positive_logits, pool_logits], dim=1) / self.temperature
        return F.cross_entropy(logits, torch.zeros_like(positive_ids))


class RankingLoss(nn.Module):
    """Binary cross-entropy of every event's action logits (the action head) against the
    action taken."""

    def __init__(self, cfg: HSTUModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = cfg.embedding_dim
        self.num_actions = cfg.num_actions
        self.action_head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, cfg.num_actions)).to(device)

    def forward(self, encoded: Encoded) -> torch.Tensor:
        logits = self.action_head(encoded.outputs)
        labels = F.one_hot(encoded.actions, self.num_actions).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, labels)


class HSTU(nn.Module):
    """The tables, the encoder and the objective's loss: ``forward(batch)`` is the loss; with
    ``zch``, the item table a managed-collision one and the actions a dense embedding."""

    def __init__(
        self, cfg: HSTUModelConfig, dense_device: torch.device, table_device: torch.device, zch: ZchConfig | None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        tables = EmbeddingCollection(tables=table_configs(cfg, zch is not None), device=table_device)
        self.embedding_collection: EmbeddingCollection | ManagedCollisionEmbeddingCollection = tables
        self.actions: nn.Embedding | None = None
        #: Whether the item table is a managed-collision one (its type changes when DMP shards it).
        self.managed = zch is not None
        if zch is not None:
            collisions = managed_collisions(tables.embedding_configs(), zch, table_device)
            self.embedding_collection = ManagedCollisionEmbeddingCollection(
                tables, collisions, return_remapped_features=True
            )
            self.actions = nn.Embedding(cfg.num_actions, cfg.embedding_dim, device=dense_device)
        self.encoder = SequenceEncoder(cfg, dense_device)
        self.loss: RetrievalLoss | RankingLoss = (
            RankingLoss(cfg, dense_device) if cfg.objective == "ranking" else RetrievalLoss(cfg.temperature)
        )

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        return self.loss(self.encode(batch))

    def encode(self, batch: SequenceBatch) -> Encoded:
        """One lookup of every table (the only one in training, so pipelines can run it early)
        and the layer stack over each user's events."""
        looked_up, rows = self.look_up(batch.features)
        if self.actions is not None:
            actions = batch.features[ACTION]
            looked_up[ACTION] = JaggedTensor(self.actions(actions.values()), lengths=actions.lengths())
        return self.encoder(looked_up, batch, rows)

    def look_up(self, features: KeyedJaggedTensor) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor]:
        """The tables' embeddings of ``features``, and the rows they were looked up at: the ids
        themselves, or with zch the item rows the managed-collision table remapped them to."""
        if not self.managed:
            return self.embedding_collection(features), features
        looked_up, rows = self.embedding_collection(features)
        # a new dict by key (the train pipelines' trace indexes the result, it cannot iterate it)
        return {ITEM: looked_up[ITEM], NEGATIVE: looked_up[NEGATIVE]}, rows


class HSTUTrain(nn.Module):
    """The model and its loss, shaped as TorchRec's ``DLRMTrain``: ``forward(batch)`` returns
    ``(loss, (loss.detach(),))``, which TorchRec's train pipelines run as they run a DLRM."""

    def __init__(self, model: HSTU) -> None:
        super().__init__()
        self.model = model

    @property
    def cfg(self) -> HSTUModelConfig:
        return self.model.cfg

    def forward(self, batch: SequenceBatch) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        loss = self.model(batch)
        return loss, (loss.detach(),)

    @torch.no_grad()
    def evaluate(self, batch: SequenceBatch, chunk_items: int = 65536) -> EvalOutput:
        """What the metrics need of a batch whose users' last event is the target (leave-last-out).

        Retrieval: the output at the event before the target (causal, so the target never
        reaches it) is the query; the candidates are the batch's ``negative_item`` ids of the
        user, where it has some, else every item, embedded ``chunk_items`` at a time through the
        same (possibly sharded: every rank calls it as often) table. The target's rank is 1 +
        the candidates other than itself that score strictly higher. Ranking: the action
        logits of the target event.
        """
        encoded = self.model.encode(batch)
        targets = encoded.layout.last_index()
        if isinstance(self.model.loss, RankingLoss):
            logits = self.model.loss.action_head(encoded.outputs[targets])
            labels = F.one_hot(encoded.actions[targets], self.cfg.num_actions).to(logits.dtype)
            return EvalOutput(action_logits=logits, action_labels=labels, target_items=encoded.items[targets])
        queries = F.normalize(encoded.outputs[targets - 1], dim=-1)
        target_rows = encoded.item_rows[targets]
        target_scores = (queries * item_vectors(encoded.item_embeddings[targets])).sum(-1)
        if encoded.negative_ids.numel():
            candidates = item_vectors(encoded.negatives.values()).view(batch.num_users, -1, queries.shape[1])
            scores = torch.einsum("ud,ucd->uc", queries, candidates)
            higher = _higher(scores, encoded.negative_rows.view(batch.num_users, -1), target_rows, target_scores)
        else:
            higher = self._higher_among_all_items(queries, target_rows, target_scores, chunk_items)
        return EvalOutput(ranks=higher + 1)

    def _higher_among_all_items(
        self, queries: torch.Tensor, target_rows: torch.Tensor, target_scores: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        """Candidates that score higher among every item: the ids ``0 .. num_items - 1``, or with
        zch every id with a row of its own (all ranks' shares, so every rank looks up as often)."""
        all_items = self._item_ids(queries.device)
        higher = torch.zeros_like(target_rows)
        for start in range(0, all_items.numel(), chunk):
            lookup: KeyedJaggedTensor = candidate_batch(all_items[start : start + chunk], queries.shape[0])
            looked_up, rows = self.model.look_up(lookup)
            items = item_vectors(looked_up[NEGATIVE].values())
            higher += _higher(queries @ items.T, rows[NEGATIVE].values()[None, :], target_rows, target_scores)
        return higher

    def _item_ids(self, device: torch.device) -> torch.Tensor:
        if not self.model.managed:
            return torch.arange(self.cfg.num_items, device=device)
        return held_ids(self.model.embedding_collection).to(device)


def _higher(
    scores: torch.Tensor, ids: torch.Tensor, target_ids: torch.Tensor, target_scores: torch.Tensor
) -> torch.Tensor:
    """Per user, the candidates other than the target itself that score strictly higher: the
    target's own column is left out, as its score computed by another kernel may differ in the
    last bit."""
    return ((scores > target_scores[:, None]) & (ids != target_ids[:, None])).sum(1)


def build_model(
    cfg: HSTUModelConfig,
    dense_device: torch.device,
    table_device: torch.device | None = None,
    zch: ZchConfig | None = None,
) -> HSTUTrain:
    """The training module (model + loss); with ``zch``, its item table a managed-collision one
    (:data:`MANAGED_TABLES`, apps/core/zch/).

    Tables are built on the meta device by default so that no rank ever allocates a whole
    table: ``DistributedModelParallel`` materialises only each rank's shards. The dense part is
    built on ``dense_device`` with the current RNG state (seed it for identical ranks).
    """
    return HSTUTrain(HSTU(cfg, dense_device, table_device or torch.device("meta"), zch))
