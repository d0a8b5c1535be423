"""Synthetic click logs: deterministic, rank-partitioned, heavy-tailed, and learnable."""

import numpy as np
import torch
from torchmetrics.classification import BinaryAUROC

from apps.core.data import RankShare
from apps.dlrm.config import JobConfig, train_config
from apps.dlrm.data.synthetic import SyntheticClickLogs

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

CFG = train_config(num_sparse_features=4, num_embeddings_per_feature=[1000, 50, 100_000, 7], batch_size=256)


def synthetic(cfg: JobConfig, rank: int = 0, world: int = 1) -> SyntheticClickLogs:
    """Rank ``rank`` of ``world``'s synthetic click logs of ``cfg``'s sections, as a job's make_data makes them."""
    return SyntheticClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training, rank, world))


def ids_of(batch, num_features):
    return batch.sparse_features.values().numpy().reshape(num_features, -1)


def test_same_seed_same_data_other_seed_other_data():
    a = synthetic(CFG).block("train", 5)
    b = synthetic(CFG).block("train", 5)
    c = synthetic(CFG.replace(seed=1)).block("train", 5)
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.labels, b.labels)
    assert not torch.equal(a.sparse_features.values(), c.sparse_features.values())


def test_ranks_split_each_global_batch_without_overlap():
    world = 3
    ranks = [synthetic(CFG, r, world) for r in range(world)]
    single = synthetic(CFG)
    for step in range(2):
        parts = [next(iter(d.train_batches(start_step=step))) for d in ranks]
        for r, part in enumerate(parts):
            expected = single.block("train", step * world + r)
            assert torch.equal(part.dense_features, expected.dense_features)
        dense = torch.cat([p.dense_features for p in parts])
        assert len({tuple(row.tolist()) for row in dense}) == dense.shape[0]  # no sample twice
    val = [next(d.eval_batches("val", 1)) for d in ranks]
    assert not torch.equal(val[0].dense_features, val[1].dense_features)
    assert not torch.equal(val[0].dense_features, parts[0].dense_features)  # splits differ


def test_ids_are_in_range_and_heavy_tailed():
    data = synthetic(CFG)
    ids = np.concatenate([ids_of(data.block("train", i), 4) for i in range(40)], axis=1)
    for t, rows in enumerate(CFG.model.table_sizes):
        assert ids[t].min() >= 0 and ids[t].max() < rows
    # table 2 has 100k rows: the hottest 1% of its rows take most of the traffic
    _, counts = np.unique(ids[2], return_counts=True)
    top = np.sort(counts)[::-1][:1000].sum() / ids.shape[1]
    assert top > 0.5
    # ... and hot ids are scattered over the table, not bunched at its start
    assert np.median(ids[2]) > 10_000


def test_teacher_sets_a_reachable_ceiling_and_labels_follow_it():
    data = synthetic(JobConfig())
    auroc = BinaryAUROC()
    for batch in data.eval_batches("val", 20):
        auroc.update(data.teacher_logits(batch), batch.labels.long())
    ceiling = auroc.compute().item()
    assert 0.75 < ceiling < 0.9
