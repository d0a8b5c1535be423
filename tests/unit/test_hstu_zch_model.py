"""The HSTU's managed-collision item table (--categorical_ids zch) compares items by their rows:
raw ids that share a row (those without one of their own share their rank's last) are one item to
the sampled softmax, whose accidental hits they are."""

import torch

from apps.core.zch.config import zch_of
from apps.hstu.config import train_config
from apps.hstu.data.batch import SequenceBatch
from apps.hstu.model import build_model

TIER = "unit"


def test_ids_without_rows_are_one_item_to_the_sampled_softmax():
    cfg = train_config(categorical_ids="zch", num_items=8, synthetic_branching=2, max_seq_len=8, num_layers=1)
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"), torch.device("cpu"), zch_of(cfg)).eval()
    raw = torch.tensor([11, 1 << 40, 3 << 50, 12345], dtype=torch.long)  # in no row yet: all in the last
    batch = SequenceBatch.of(
        items=raw[:3],
        actions=torch.zeros(3, dtype=torch.long),
        timestamps=torch.arange(3, dtype=torch.long) * 60,
        lengths=torch.tensor([3]),
        negatives=raw[3:].view(1, 1),
    )
    encoded = model.model.encode(batch)
    assert encoded.item_rows.tolist() == [7, 7, 7] and encoded.negative_rows.tolist() == [7]
    # every pool item is the positive's row: masked as an accidental hit, the positive alone is left
    assert float(model.model.loss(encoded)) == 0.0
