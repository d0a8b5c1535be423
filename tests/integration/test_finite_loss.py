"""A run whose training loss stops being finite ends FAILED at once, with one line naming the step,
having committed no checkpoint after it (the guard of apps/core/training/trainer.py)."""

import json
import re

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import tiny, torchrun

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


def tensors(value) -> list[torch.Tensor]:
    """Every tensor in a loaded checkpoint's nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for item in value for t in tensors(item)] if isinstance(value, list) else []


def test_a_non_finite_loss_stops_every_rank_naming_its_step_and_nothing_after_it_is_committed(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    # A learning rate of 1e30 takes the weights to inf within a few steps, and the loss to NaN;
    # a checkpoint every step would commit whatever the guard let through.
    diverging = ["--learning_rate", "1e30", "--dense_learning_rate", "1e30", "--checkpoint_every", "1"]
    args = [*tiny(steps=30, log_every=10), *diverging, "--checkpoint_dir", str(ckpt), "--output_dir", str(out)]
    result = torchrun(["-m", "apps.dlrm.train", *args], timeout=300)
    assert result.returncode != 0, result.stderr[-4000:]
    # Logged once, by rank 0; torchrun's failure table quotes it too, from the ranks' error files.
    lines = [
        line for line in result.stderr.splitlines() if "the training loss is not finite" in line and " ERROR " in line
    ]
    assert len(lines) == 1, result.stderr[-4000:]
    assert f"traceback : {lines[0].split(' ERROR ', 1)[1]}" in result.stderr
    step = int(re.search(r"step (\d+): the training loss is not finite", lines[0])[1])
    committed = sorted(int(p.name.split("_")[-1]) for p in ckpt.glob("step_*") if (p / "COMMITTED").exists())
    assert committed and max(committed) < step
    for kept in committed:
        dcp_to_torch_save(ckpt / f"step_{kept:08d}", tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=False)
        assert all(torch.isfinite(t).all() for t in tensors(state) if t.is_floating_point()), kept
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] in lines[0] and summary["failed_step"] == step
