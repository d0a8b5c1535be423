"""Every app's data, model, training step and evaluation keep their tensors on the job's device.

What a GPU job runs, run here on a second device (tests/other_device.py) on which a tensor left
on the CPU fails as on a GPU: an HSTU job on an H200 died at its first step so, in its synthetic
source, while every CPU test passed. Each app's sources (synthetic and Parquet) and model go
through the Trainer's own steps: ``make_data`` and ``build_model`` for the rank's device,
each batch moved there as the train pipeline moves it, a training step with the fused and the
dense optimizers, and ``evaluate`` with the app's metrics (the synthetic data's ceiling among
them). Sharding aside: DistributedModelParallel would put the tables on the device, which here
is done in place before their optimizer is fused (TorchRec's sharded kernels are FBGEMM's, not
the app's code).
"""

import math

import fsspec
import pytest
import torch

from apps.core.common.distributed import DistEnv
from apps.core.training.optim import dense_optimizer, fuse_embedding_optimizer
from apps.core.training.trainer import evaluate
from apps.dlrm.config import train_config as dlrm_config
from apps.dlrm.training.app import DLRM
from apps.hstu.config import train_config as hstu_config
from apps.hstu.training.app import HSTU
from tests.integration.test_parquet_data import DENSE, SPARSE, TABLES, write_files
from tests.other_device import DEVICE, OnDevice, OtherDevice
from tests.unit.test_hstu_data import write_per_event

# Tier (tests/conftest.py): in this process, seconds.
TIER = "unit"

ENV = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=DEVICE, backend="gloo")


def step_and_evaluate(app, cfg) -> tuple[torch.Tensor, dict[str, float], list[float]]:
    """One training step and one validation of ``app`` on the device: the step's loss, the
    validation's metrics and how far the step moved the tables and the dense part."""
    with OtherDevice():
        data = app.make_data(cfg, ENV)
        model = app.build_model(cfg, DEVICE)
        (path,) = app.tables.paths  # one collection
        tables = model.get_submodule(path)
        # What sharding does with the tables built on the meta device: this rank's, on the device.
        tables.to_empty(device=DEVICE)
        with torch.no_grad():
            for weight in tables.parameters():
                weight.uniform_(-0.05, 0.05)
        fuse_embedding_optimizer(cfg.training, tables.parameters())
        before = [p.detach().clone() for p in (next(tables.parameters()), dense(model, app)[0])]
        optimizer = dense_optimizer(cfg.training, model, app.tables)
        with torch.no_grad():
            batch = next(data.train_batches()).to(DEVICE)  # what the train pipeline's copy does
        loss, _ = model(batch)
        loss.backward()  # the tables' optimizer runs in it
        optimizer.step()
        after = [next(tables.parameters()), dense(model, app)[0]]
        moved = [float((a - b).abs().max()) for a, b in zip(after, before)]
        val = evaluate(app, cfg, model, data.eval_batches("val", 2), ENV, app.eval_metrics(cfg, data, "val", DEVICE))
        return loss, val, moved


def dense(model: torch.nn.Module, app) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith(tuple(app.tables.paths))]


def check(loss: torch.Tensor, val: dict[str, float], moved: list[float], expected: set[str]) -> None:
    assert isinstance(loss, OnDevice) and math.isfinite(loss.detach().item())
    assert expected <= set(val) and all(math.isfinite(value) for value in val.values()), val
    assert all(step > 0 for step in moved), moved  # both optimizers updated their parameters


def test_a_cpu_tensor_beside_a_device_one_fails_as_on_a_gpu():
    """The second device's rule is CUDA's: what the H200 raised, it raises."""
    with OtherDevice():
        on_device = torch.rand(4, device=DEVICE, dtype=torch.float64)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.searchsorted(torch.arange(3, dtype=torch.float64), on_device)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            on_device + torch.ones(4, dtype=torch.float64)
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            torch.arange(4)[torch.arange(2, device=DEVICE)]
        # as on CUDA: CPU scalars, CPU indices of a device tensor, and copies between the two
        assert isinstance(on_device * torch.tensor(2.0), OnDevice)
        assert isinstance(on_device[torch.arange(2)], OnDevice)
        assert type(on_device.cpu()) is torch.Tensor and torch.equal(on_device.cpu(), on_device.values)
        assert int(torch.tensor([1, 5], device=DEVICE).max()) == 5


@pytest.mark.parametrize(
    "options",
    [
        dict(objective="retrieval"),  # the target ranked among all items, in chunks
        dict(objective="retrieval", eval_negatives=20, dropout=0.1),
        dict(objective="ranking"),
    ],
)
def test_hstu_on_synthetic_users(options):
    """The job that died on the H200 at its first step."""
    cfg = hstu_config(num_items=60, max_seq_len=8, num_layers=1, num_heads=1, embedding_dim=8, batch_size=4, **options)
    ranking = options["objective"] == "ranking"
    check(
        *step_and_evaluate(HSTU, cfg), {"auroc", "auroc_ceiling"} if ranking else {"hr@10", "ndcg@10", "hr@10_ceiling"}
    )


def test_hstu_on_parquet_sequences(tmp_path):
    write_per_event(tmp_path / "events.parquet")
    cfg = hstu_config(
        data="parquet",
        data_path=str(tmp_path),
        layout="per_event",
        user_column="user",
        item_column="movie",
        action_column="rating",
        timestamp_column="ts",
        num_items=10,
        num_actions=3,
        max_seq_len=8,
        num_layers=1,
        num_heads=1,
        embedding_dim=8,
        batch_size=2,
    )
    check(*step_and_evaluate(HSTU, cfg), {"hr@10", "ndcg@10", "mrr"})


def test_dlrm_on_synthetic_click_logs():
    cfg = dlrm_config(num_embeddings=100, batch_size=32, num_sparse_features=3, multi_hot_sizes=[1, 3, 2])
    check(*step_and_evaluate(DLRM, cfg), {"auroc", "log_loss", "accuracy", "auroc_ceiling"})


def test_dlrm_on_parquet_click_logs(tmp_path):
    folder = write_files(fsspec.filesystem("file"), str(tmp_path))
    cfg = dlrm_config(
        data="parquet",
        data_path=folder,
        num_embeddings=TABLES,
        batch_size=100,
        dense_columns=DENSE,
        sparse_columns=SPARSE,
        categorical_ids="as_is",
    )
    check(*step_and_evaluate(DLRM, cfg), {"auroc", "log_loss", "accuracy"})
