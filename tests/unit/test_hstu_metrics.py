"""The HSTU app's metrics against hand-computed values, combined across two real ranks, and a
small model trained on synthetic users against the random baseline and the planted ceiling."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from apps.core.common.distributed import free_port
from apps.core.data import RankShare
from apps.hstu.config import HSTUModelConfig, SequenceDataConfig, train_config
from apps.hstu.data import make_dataset
from apps.hstu.metrics import ActionAUROC, RetrievalMetrics, auroc
from apps.hstu.model import build_model
from apps.hstu.training.app import SequenceMetrics

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

CPU = torch.device("cpu")


def test_retrieval_metrics_by_hand():
    metrics = RetrievalMetrics(k=10)
    metrics.update(torch.tensor([1, 3]))
    metrics.update(torch.tensor([11, 2]))
    result = metrics.compute()
    assert result["hr@10"] == pytest.approx(3 / 4)
    assert result["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4) + 0 + 1 / math.log2(3)) / 4)
    assert result["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 11 + 1 / 2) / 4)


def test_retrieval_metrics_refuse_to_average_no_user():
    with pytest.raises(ValueError, match="no user was evaluated"):
        RetrievalMetrics().compute()


def test_auroc_by_hand():
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5, 0.2]), torch.tensor([1, 0, 0])) == pytest.approx(0.75)  # a tie counts half
    assert math.isnan(auroc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))


def test_action_auroc_is_per_action():
    metrics = ActionAUROC(num_actions=2)
    logits = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.3]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    metrics.update(logits, labels)
    assert metrics.compute() == {"auroc_action_0": 1.0, "auroc_action_1": 1.0}
    metrics.update(torch.tensor([[0.95, 0.0]]), torch.tensor([[0.0, 1.0]]))
    assert metrics.compute() == {"auroc_action_0": pytest.approx(2 / 3), "auroc_action_1": pytest.approx(2 / 3)}


RANKS = [torch.tensor([1, 4, 12]), torch.tensor([2, 7])]
LOGITS = [torch.tensor([[0.1], [0.7], [0.4]]), torch.tensor([[0.9], [0.3]])]
LABELS = [torch.tensor([[0.0], [1.0], [0.0]]), torch.tensor([[1.0], [1.0]])]


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    retrieval, actions = RetrievalMetrics(k=5), ActionAUROC(num_actions=1)
    retrieval.update(RANKS[rank])
    actions.update(LOGITS[rank], LABELS[rank])
    results[rank] = {**retrieval.compute(), **actions.compute()}
    dist.destroy_process_group()


def test_two_ranks_compute_what_one_process_computes_of_all_their_users():
    alone, actions = RetrievalMetrics(k=5), ActionAUROC(num_actions=1)
    alone.update(torch.cat(RANKS))
    actions.update(torch.cat(LOGITS), torch.cat(LABELS))
    expected = {**alone.compute(), **actions.compute()}
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="fork")
    assert results[0] == pytest.approx(expected) and results[1] == pytest.approx(expected)


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from threads, and on a loaded machine two spinning threads make
    each step ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained(model_cfg: HSTUModelConfig, steps: int):
    """A model of ``model_cfg`` after ``steps`` Adam steps on synthetic users, and their source."""
    torch.manual_seed(0)
    source = make_dataset(
        model_cfg, SequenceDataConfig(synthetic_noise=0.2), RankShare(0, 1, seed=0, batch_size=64), CPU
    )
    train = build_model(model_cfg, CPU, CPU)
    optimizer = torch.optim.Adam(train.parameters(), lr=0.01)
    for _, batch in zip(range(steps), source.train_batches()):
        loss, _ = train(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return train.eval(), source


def test_a_small_ranking_model_learns_the_planted_actions_up_to_their_ceiling(one_thread):
    """The ranking objective's ceiling is the AUROC of the logits the synthetic actions are drawn
    with, on the same target events: a model that learned each item's actions comes close to it
    and not above it by more than the sampling error of 512 users."""
    model_cfg = HSTUModelConfig(
        num_items=100, embedding_dim=32, num_layers=1, num_heads=1, attention_dim=16, linear_dim=16,
        max_seq_len=10, objective="ranking",
    )  # fmt: skip
    train, source = trained(model_cfg, 300)
    metrics = SequenceMetrics(train_config(objective="ranking"), CPU, None, source.action_oracle())
    with torch.no_grad():
        for batch in source.eval_batches("val", 8):
            metrics.update(batch, train.evaluate(batch))
    result = metrics.compute()
    assert 0.6 < result["auroc_ceiling"] < 1, result  # the actions depend on the item, not wholly
    assert result["auroc_ceiling"] - 0.07 < result["auroc"] < result["auroc_ceiling"] + 0.03, result
    untrained = SequenceMetrics(train_config(objective="ranking"), CPU, None, source.action_oracle())
    fresh = build_model(model_cfg, CPU, CPU).eval()
    with torch.no_grad():
        for batch in source.eval_batches("val", 8):
            untrained.update(batch, fresh.evaluate(batch))
    assert untrained.compute()["auroc"] < result["auroc_ceiling"] - 0.1  # the ceiling is not a given


def test_a_small_model_learns_the_planted_transitions(one_thread):
    """300 steps of a one-layer model (about 10 s): HR@10 and NDCG@10 far above ranking at
    random (HR@10 0.1 of 100 items), within 0.07 of the Bayes-optimal ceiling, and not above it
    by more than the evaluation's sampling error (512 users)."""
    torch.manual_seed(0)
    model_cfg = HSTUModelConfig(
        num_items=100,
        embedding_dim=32,
        num_layers=1,
        num_heads=1,
        attention_dim=16,
        linear_dim=16,
        max_seq_len=10,
        temperature=0.1,
    )
    source = make_dataset(
        model_cfg, SequenceDataConfig(synthetic_noise=0.2), RankShare(0, 1, seed=0, batch_size=64), CPU
    )
    train = build_model(model_cfg, CPU, CPU)
    optimizer = torch.optim.Adam(train.parameters(), lr=0.01)
    for _, batch in zip(range(300), source.train_batches()):
        loss, _ = train(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    train.eval()
    metrics = RetrievalMetrics(k=10)
    for batch in source.eval_batches("val", 8):
        metrics.update(train.evaluate(batch).ranks)
    result, ceiling = metrics.compute(), source.ceiling()
    for name in ("hr@10", "ndcg@10"):
        assert ceiling[name] - 0.07 < result[name] < ceiling[name] + 0.05, (name, result, ceiling)
