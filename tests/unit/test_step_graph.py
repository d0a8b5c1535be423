"""The training step in one CUDA graph (apps/core/training/step_graph.py): which runs capture it,
when a learning rate is captured again, which batches replay it, the static batch's copies
(on CPU), and on a GPU the graph's losses against the eager step's, step for step, and a main
job trained, validated, checkpointed and resumed with it.
"""

import json
import math

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.core.config import LaunchConfig, TrainingConfig
from apps.core.training.optim import LRShape, lr_scale
from apps.core.training.step_graph import (
    MIN_STEPS_PER_CAPTURE,
    WARMUP_STEPS,
    GraphPolicy,
    _copy_into,
    _host_step_counts,
    _static_copy,
    batch_signature,
    graph_kind,
    lr_holds_for,
    step_graph_refusal,
)
from apps.dlrm.data.criteo.tables import MLPERF_MULTI_HOT_SIZES
from tests.conftest import LOCAL_TRAIN_1X2, TINY, assert_ok, run, torchrun

# Tier (tests/conftest.py): in this process, seconds; the end-to-end tests are marked apart.
TIER = "unit"

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")


@pytest.mark.parametrize(
    "launch, training, device, not_lean, kernels, refusal",
    [
        ({}, {}, "cuda", "", ["fused", "dense"], ""),
        (dict(step_graph="false"), {}, "cuda", "", ["fused"], "--step_graph false"),
        ({}, {}, "cpu", "", ["fused"], "CUDA graphs need a GPU, this run is on cpu"),
        ({}, {}, "cuda", "2 ranks", ["fused"], "TorchRec's sharded step runs"),
        (
            dict(compile_dense="default"),
            {},
            "cuda",
            "",
            ["fused"],
            "--compile_dense default compiles the dense part apart",
        ),
        (
            {},
            dict(embedding_optimizer="adam"),
            "cuda",
            "",
            ["fused"],
            "FBGEMM's Adam reads its step on the host (--embedding_optimizer adam)",
        ),
        (
            {},
            dict(dense_optimizer="adam"),
            "cuda",
            "",
            ["fused"],
            "torch's Adam as built here is not capturable (--dense_optimizer adam)",
        ),
        (
            {},
            {},
            "cuda",
            "",
            ["fused", "fused_uvm_caching"],
            "fused_uvm_caching tables prefetch rows on the host",
        ),
    ],
)
def test_the_step_graph_runs_on_gpus_for_the_lean_step_and_says_why_not(
    launch, training, device, not_lean, kernels, refusal
):
    got = step_graph_refusal(LaunchConfig(**launch), TrainingConfig(**training), device, not_lean, kernels)
    assert got == refusal
    assert graph_kind(got).startswith("one CUDA graph") if not refusal else graph_kind(got).endswith(refusal)


def test_the_learning_rate_holds_until_the_schedule_changes_it():
    """Warm-up over 5 steps, then 1.0 until a decay from step 30 over 2 steps, then 0.25."""
    shape = LRShape(warmup_steps=5, decay_start=30, decay_steps=2)
    assert [lr_holds_for(shape, step) for step in range(4)] == [1, 1, 1, 1]  # a new rate every step
    assert lr_holds_for(shape, 4) == MIN_STEPS_PER_CAPTURE  # the last warm-up step is at 1.0
    assert lr_holds_for(shape, 20) == 11  # steps 20..30 at 1.0; 31 decays
    assert lr_holds_for(shape, 31) == MIN_STEPS_PER_CAPTURE  # 0.25 from there on
    assert lr_holds_for(shape, 31, horizon=1000) == 1000
    assert lr_scale(shape, 30) == 1.0 and lr_scale(shape, 31) == 0.25


def batch(lengths: list[int], per_key: bool, rows: int = 4) -> Batch:
    """Two features over ``rows`` samples with ``lengths`` ids each (feature-major), with the
    per-key sizes on the host as Criteo's and Parquet's loaders give them, or without."""
    n = sum(lengths)
    sizes = [sum(lengths[:rows]), sum(lengths[rows:])]
    return Batch(
        dense_features=torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + n,
        sparse_features=KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.arange(n) + 100 * n,
            lengths=torch.tensor(lengths, dtype=torch.int32),
            length_per_key=sizes if per_key else None,
        ),
        labels=torch.ones(rows) * n,
    )


def test_a_batch_replays_only_with_the_shapes_and_per_key_sizes_it_was_captured_with():
    one_hot = [1] * 8
    assert batch_signature(batch(one_hot, True)) == batch_signature(batch(one_hot, True))
    assert batch_signature(batch(one_hot, False)) == batch_signature(batch(one_hot, False))
    # The same number of ids split otherwise among the features (variable-length lists).
    assert batch_signature(batch([2, 1, 1, 1, 1, 1, 1, 1], True)) != batch_signature(
        batch([1, 1, 1, 1, 1, 1, 1, 2], True)
    )
    assert batch_signature(batch(one_hot, True)) != batch_signature(batch([1] * 6, True, rows=3))  # a partial batch


def test_the_static_batch_takes_each_batch_s_values():
    first, second = batch([1] * 8, True), batch([1] * 8, True)
    second.dense_features += 7
    second.sparse_features.values().add_(5)
    static = _static_copy(first, torch.device("cpu"))
    assert static.dense_features.data_ptr() != first.dense_features.data_ptr()
    assert static.sparse_features.length_per_key() == [4, 4]
    _copy_into(static, second, torch.device("cpu"))
    assert torch.equal(static.dense_features, second.dense_features)
    assert torch.equal(static.sparse_features.values(), second.sparse_features.values())
    assert torch.equal(static.sparse_features.offsets(), second.sparse_features.offsets())
    assert torch.equal(static.labels, second.labels)


def test_a_replay_advances_the_step_counts_optimizers_keep_on_the_host():
    """torch's Adagrad and TorchRec's RowWiseAdagrad count steps in CPU tensors, which a replay
    does not run: the pipeline advances these very tensors (the ones checkpoints save)."""
    mlp, table = nn.Linear(2, 1), nn.Linear(2, 2, bias=False)  # row-wise: 2-D weights only
    optimizer = CombinedOptimizer(
        [
            ("dense", KeyedOptimizerWrapper(dict(mlp.named_parameters()), lambda ps: torch.optim.Adagrad(ps))),
            ("tables", KeyedOptimizerWrapper(dict(table.named_parameters()), lambda ps: RowWiseAdagrad(ps))),
        ]
    )
    (mlp(torch.ones(1, 2)).sum() + table(torch.ones(1, 2)).sum()).backward()
    optimizer.step()
    steps = _host_step_counts(optimizer)
    assert len(steps) == 3 and all(step.item() == 1 for step in steps)
    torch._foreach_add_(steps, 1.0)
    saved = optimizer.state_dict()["state"]
    assert sorted(state["step"].item() for state in saved.values()) == [2.0] * 3, saved


def test_steps_warm_up_capture_replay_and_capture_again_when_the_learning_rate_changes():
    policy, shape, odd = GraphPolicy(), ("batch",), ("partial batch",)
    steps = [policy.action(shape, (0.1,), 1) for _ in range(WARMUP_STEPS)]
    assert steps == ["warm"] * WARMUP_STEPS
    assert policy.action(shape, (0.2,), 1) == "eager"  # a rate of one step: not worth a capture
    assert policy.action(shape, (0.3,), MIN_STEPS_PER_CAPTURE) == "capture"
    assert policy.action(shape, (0.3,), 5) == "replay"  # captured at this rate: replayed however long it holds
    assert policy.action(odd, (0.3,), 5) == "eager"
    assert policy.action(shape, (0.3,), 5) == "replay"
    assert policy.action(shape, (0.4,), MIN_STEPS_PER_CAPTURE) == "capture"
    policy.forget()  # a checkpoint was loaded
    assert policy.action(shape, (0.4,), MIN_STEPS_PER_CAPTURE) == "capture"


def test_batches_whose_shapes_vary_run_eager_for_good():
    policy = GraphPolicy()
    for size in range(WARMUP_STEPS):
        assert policy.action((size,), (0.1,), MIN_STEPS_PER_CAPTURE) == "warm"
    assert [policy.action((0,), (0.1,), MIN_STEPS_PER_CAPTURE) for _ in range(3)] == ["eager"] * 3
    assert policy.varying


# --- end to end: a graph run against an eager one -------------------------------------------------

#: 50 steps (0-based below): 0-2 warm up, 3 runs eager (the rate ramps), 4 captures at 1.0 and
#: 5-25 replay; 26 captures again at 0.25 (a decay over 2 steps: one jump) and 27-49 replay.
SCHEDULE = ["--steps", "50", "--lr_warmup_steps", "5", "--lr_decay_start", "25", "--lr_decay_steps", "2"]


def step_losses(out_dir) -> list[float]:
    """Each step's training loss from a run with --log_every 1 (metrics.jsonl, full precision)."""
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if line["kind"] == "train"]


def assert_same_losses(graph: list[float], eager: list[float], tolerance: float) -> None:
    """The same number of steps, each loss finite and within ``tolerance`` of the other's."""
    assert len(graph) == len(eager) > 0, (len(graph), len(eager))
    differences = [abs(a - b) for a, b in zip(graph, eager)]
    assert all(math.isfinite(x) for x in graph + eager), (graph, eager)
    worst = max(range(len(differences)), key=differences.__getitem__)
    assert differences[worst] <= tolerance, f"step {worst + 1}: {graph[worst]} vs {eager[worst]}"


def test_the_loss_comparison_names_the_first_step_that_differs(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"kind": kind, "step": i, "loss": 0.5 + i}) for i, kind in enumerate(["train", "val", "train"])
        )
    )
    assert step_losses(tmp_path) == [0.5, 2.5]
    assert_same_losses([0.5, 2.5], [0.5, 2.50005], 1e-4)
    with pytest.raises(AssertionError, match="step 2: 2.5 vs 2.6"):
        assert_same_losses([0.5, 2.5], [0.5, 2.6], 1e-4)
    with pytest.raises(AssertionError):
        assert_same_losses([0.5, math.nan], [0.5, math.nan], 1e-4)


def train_once(tmp_path, name: str, *args: str) -> tuple[list[float], str]:
    """One rank of the DLRM trained with ``args``: its per-step losses and its log."""
    out = tmp_path / name
    result = torchrun(
        ["-m", "apps.dlrm.train", *TINY, *SCHEDULE, "--log_every", "1", "--output_dir", str(out), *args], nproc=1
    )
    assert_ok(result)
    return step_losses(out), result.stderr


@pytest.mark.integration
def test_on_cpu_the_step_graph_does_nothing_and_says_why(tmp_path):
    graph, log = train_once(tmp_path, "auto")
    eager, _ = train_once(tmp_path, "false", "--step_graph", "false")
    assert graph == eager  # the same eager steps, to the last bit
    assert "lean step: eager, not a CUDA graph: CUDA graphs need a GPU, this run is on cpu" in log


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("hot", ["one_hot", "multi_hot"])
def test_graph_and_eager_steps_train_to_the_same_losses_across_a_learning_rate_change(hot, tmp_path):
    """TF32 off, 50 steps through warm-up, two captures (a learning-rate jump at step 26) and
    replays: every step's loss within 1e-4 of the eager step's, one-hot and fixed multi-hot."""
    options = ["--allow_tf32", "false"]
    if hot == "multi_hot":
        options += ["--multi_hot_sizes", ",".join(map(str, MLPERF_MULTI_HOT_SIZES)), "--pooling", "mean"]
    graph, log = train_once(tmp_path, "graph", *options)
    eager, _ = train_once(tmp_path, "eager", *options, "--step_graph", "false")
    assert_same_losses(graph, eager, 1e-4)
    assert log.count("training steps now replay one CUDA graph, captured at learning rates") == 2, log[-5000:]


@pytest.mark.gpu
@needs_gpu
def test_a_main_job_trains_validates_checkpoints_and_resumes_with_the_step_graph(tmp_path):
    """The README's job on one GPU with the step graph (the default): it trains, validates,
    checkpoints and tests; resumed for 100 more steps it goes on from the checkpoint, replaying."""
    out, ckpt = tmp_path / "outputs", tmp_path / "ckpt"

    def job(steps: int, name: str):
        args = ["--steps", str(steps), "--val_every_steps", "100", "--checkpoint_every", "100", "--val_batches", "8"]
        command = [*LOCAL_TRAIN_1X2[:-1], "1x1", "--gpu", "1", *args]
        result = run([*command, "--output_dir", str(out / name), "--checkpoint_dir", str(ckpt)], cwd=str(tmp_path))
        assert_ok(result)
        assert "job finished: SUCCEEDED" in result.stdout + result.stderr, result.stderr[-5000:]
        log = result.stdout + result.stderr
        assert "lean step: one CUDA graph" in log and "training steps now replay one CUDA graph" in log, log[-5000:]
        return json.loads((out / name / "summary.json").read_text())

    first = job(200, "first")
    assert first["device"] == "cuda" and first["steps"] == 200 and first["val_auroc"] > 0.6
    assert (ckpt / "step_00000200" / "COMMITTED").is_file()
    resumed = job(300, "resumed")
    assert resumed["resumed_from_step"] == 200 and resumed["steps"] == 300
    assert all(math.isfinite(resumed[name]) for name in ("val_auroc", "test_auroc", "final_train_loss"))
    assert resumed["val_auroc"] > 0.6 and resumed["test_step"] == resumed["best_step"]
