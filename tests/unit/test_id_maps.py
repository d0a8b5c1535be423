"""What a managed-collision checkpoint split over another world size rests on
(apps/core/checkpoint/id_maps.py): which ids each rank takes, as FBGEMM's bucketizer sends them,
and which ids keep their rows where a rank has too few, as TorchRec's eviction policies rank them.
The split itself, end to end: tests/integration/test_zch.py."""

import pytest
import torch
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

from apps.core.checkpoint.id_maps import blocks, keep_scores, kept, splits
from apps.core.zch.config import INPUT_HASH_SIZE

TIER = "unit"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_each_rank_takes_the_ids_fbgemms_bucketizer_sends_it(world_size):
    """TorchRec's row-wise input dist of a managed-collision table (buckets: one per rank)."""
    ranges = blocks(INPUT_HASH_SIZE, world_size)
    assert ranges[0][0] == 0 and ranges[-1][1] == INPUT_HASH_SIZE
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    edges = [i for start, end in ranges for i in (start, start + 1, end - 1)]
    ids = torch.tensor([*edges, *torch.randint(0, INPUT_HASH_SIZE, (64,)).tolist()])
    size = torch.tensor([-(-INPUT_HASH_SIZE // world_size)])
    lengths, *_ = torch.ops.fbgemm.block_bucketize_sparse_features(
        torch.ones(len(ids), dtype=torch.long),
        ids,
        bucketize_pos=False,
        sequence=False,
        block_sizes=size,
        my_size=world_size,
        total_num_blocks=torch.tensor([world_size]),
        keep_orig_idx=True,
    )
    sent_to = lengths.view(world_size, len(ids)).argmax(0)
    ours = torch.tensor([next(r for r, (start, end) in enumerate(ranges) if start <= i < end) for i in ids.tolist()])
    assert torch.equal(sent_to, ours)


def test_only_a_world_size_that_does_not_divide_the_saved_one_splits():
    assert not splits(4, 2) and not splits(2, 1) and not splits(2, 2)
    assert splits(1, 2) and splits(2, 4) and splits(2, 3) and splits(3, 2)


def test_all_ids_keep_their_rows_where_they_fit_in_order_of_id():
    ids = torch.tensor([30, 10, 20])
    assert kept(ids, torch.tensor([1.0, 2.0, 3.0]), room=3).tolist() == [1, 2, 0]


def test_where_they_do_not_fit_the_highest_ranked_keep_theirs():
    ids = torch.tensor([30, 10, 20, 40])
    assert kept(ids, torch.tensor([5.0, 1.0, 5.0, 7.0]), room=2).tolist() == [0, 3]
    # of equal scores, the first
    assert kept(ids, torch.tensor([5.0, 1.0, 5.0, 1.0]), room=1).tolist() == [0]


def test_the_policies_rank_ids_as_torchrec_scores_them_at_an_eviction():
    metadata = {"counts": torch.tensor([10, 4, 4]), "last_access_iter": torch.tensor([2, 9, 5])}
    step = 10  # since last seen: 9, 2 and 6 steps (TorchRec counts the current one too)
    assert keep_scores(LFU_EvictionPolicy(), metadata, step).tolist() == [10, 4, 4]
    assert torch.argsort(keep_scores(LRU_EvictionPolicy(), metadata, step), descending=True).tolist() == [1, 2, 0]
    distance = keep_scores(DistanceLFU_EvictionPolicy(), metadata, step)
    assert torch.allclose(distance, torch.tensor([10 / 9, 4 / 2, 4 / 6], dtype=torch.float64))
