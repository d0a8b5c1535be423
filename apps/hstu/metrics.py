"""Leave-last-out metrics of the HSTU app, each rank summing its own users and ``compute()``
combining the ranks (all-reduce over the default process group, or the one given).

Retrieval, from the target's rank r among the candidates (1 = first): HR@K = mean [r <= K],
NDCG@K = mean [r <= K] / log2(r + 1) (one relevant item, so the ideal DCG is 1), MRR = mean 1/r.
Ranking: AUROC per action, of the action's logit on the target event against whether that
action was taken (ties counted half, as the Mann-Whitney statistic does).
"""

import torch
import torch.distributed as dist

from apps.core.common.distributed import gather_rows

CPU = torch.device("cpu")


def rank_metrics(ranks: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per user: hit@k, ndcg@k and the reciprocal rank, float64."""
    ranks = ranks.double()
    hit = (ranks <= k).double()
    return {f"hr@{k}": hit, f"ndcg@{k}": hit / torch.log2(ranks + 1), "mrr": 1 / ranks}


def _reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
    return tensor


class RetrievalMetrics:
    """HR@k, NDCG@k, MRR over the users seen by every rank."""

    def __init__(self, k: int = 10, device: torch.device = CPU) -> None:
        self.k = k
        self.names = list(rank_metrics(torch.ones(1), k))
        self.sums = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=device)  # the metrics, users

    def update(self, ranks: torch.Tensor) -> None:
        per_user = rank_metrics(ranks.to(self.sums.device), self.k)
        self.sums += torch.stack([*(per_user[name].sum() for name in self.names), self.sums.new_tensor(ranks.numel())])

    def compute(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """The means over all ranks' users (a collective: every rank calls it)."""
        sums = _reduce(self.sums, group)
        users = float(sums[-1])
        if users == 0:
            raise ValueError("no user was evaluated: give at least one evaluation batch")
        return {name: float(value) / users for name, value in zip(self.names, sums[:-1])}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` for binary ``labels``: the probability that a
    positive scores above a negative, ties counted half; NaN without both classes."""
    labels = labels.bool()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    values, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)
    below = torch.cumsum(counts, 0) - counts  # scores strictly lower than each distinct value
    average_rank = below + (counts + 1) / 2  # 1-based, ties sharing their mean rank
    rank_sum = average_rank[inverse][labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


class ActionAUROC:
    """AUROC per action over the target events of every rank (gathered: AUROC needs every score)."""

    def __init__(self, num_actions: int) -> None:
        self.num_actions = num_actions
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.logits.append(logits.detach().float())
        self.labels.append(labels.detach().float())

    def compute(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """``auroc_action_<a>`` for every action (a collective: every rank calls it)."""
        logits = gather_rows(torch.cat(self.logits).view(-1, self.num_actions), group)
        labels = gather_rows(torch.cat(self.labels).view(-1, self.num_actions), group)
        return {f"auroc_action_{a}": auroc(logits[:, a], labels[:, a]) for a in range(self.num_actions)}
