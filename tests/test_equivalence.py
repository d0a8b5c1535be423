"""Sharding changes where the tables live, not what is learned: 2 sharded ranks and one plain
unsharded process, from the same weights on the same samples, follow the same loss trajectory."""

import json

import pytest
import torch

from apps.dlrm.config import TrainConfig
from apps.dlrm.data.synthetic import SyntheticClickLogs
from apps.dlrm.model import build_model
from apps.dlrm.optim import optimizer_class
from apps.dlrm.options import to_argv
from tests.conftest import REPO, assert_ok, torchrun

WORLD = 2
STEPS = 20


def reference_losses(cfg: TrainConfig, init: dict[str, torch.Tensor]) -> list[float]:
    """Plain PyTorch: unsharded tables, unfused optimizers, the global batch in one process."""
    model = build_model(cfg, dense_device=torch.device("cpu"), table_device=torch.device("cpu"))
    model.load_state_dict(init)
    tables = list(model.model.sparse_arch.parameters())
    dense = [p for name, p in model.named_parameters() if "sparse_arch" not in name]
    table_cls, table_kwargs = optimizer_class(cfg.embedding_optimizer, cfg.learning_rate)
    dense_cls, dense_kwargs = optimizer_class(cfg.dense_optimizer, cfg.dense_lr)
    optimizers = [table_cls(tables, **table_kwargs), dense_cls(dense, **dense_kwargs)]
    data = SyntheticClickLogs(cfg, rank=0, world_size=1)
    losses = []
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        # the global batch of a step is the blocks of all ranks; its loss is their mean
        loss = sum(model(data.block("train", step * WORLD + r))[0] for r in range(WORLD)) / WORLD
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_sharded_training_matches_unsharded_reference(sharding_type, tmp_path):
    cfg = TrainConfig(num_embeddings=500, batch_size=64, sharding_type=sharding_type, output_dir="")
    torch.manual_seed(1234)
    init = build_model(cfg, torch.device("cpu"), table_device=torch.device("cpu")).state_dict()
    torch.save(init, tmp_path / "init.pt")
    out = tmp_path / "losses.json"
    result = torchrun(
        [f"{REPO}/tests/equivalence_worker.py", str(tmp_path / "init.pt"), str(out), str(STEPS), *to_argv(cfg)],
    )
    assert_ok(result)
    sharded = json.loads(out.read_text())
    assert set(sharded["plan"]) == {sharding_type}
    expected = reference_losses(cfg, init)
    assert len(sharded["losses"]) == STEPS
    assert sharded["losses"] == pytest.approx(expected, abs=1e-4), (sharded["losses"], expected)
    assert expected[-1] < expected[0]  # and it is actually learning
