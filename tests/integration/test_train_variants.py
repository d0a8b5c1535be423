"""Every sharding type, interaction, pipeline, comm precision and dense speed option trains on
CPU with gloo; the GPU-only ones are refused there before training."""

import json
import math
import sys

import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.core.training.device_support import check_device_support
from apps.dlrm.config import parse_train_config, train_config
from apps.dlrm.model import build_model, speed_up_dense
from apps.dlrm.training.app import DLRM
from tests.conftest import LOCAL_TRAIN_1X2, TINY, assert_ok, run, tiny, torchrun
from tests.unit.test_synthetic import synthetic

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

VARIANTS = {
    "table_wise+fp16/bf16+val_every_steps": (
        [
            "--sharding_type",
            "table_wise",
            "--qcomm_forward_precision",
            "fp16",
            "--qcomm_backward_precision",
            "bf16",
            "--val_every_steps",
            "20",
        ],
        "table_wise",
    ),
    "row_wise+dcn+bf16": (
        ["--sharding_type", "row_wise", "--interaction_type", "dcn", "--qcomm_forward_precision", "bf16"],
        "row_wise",
    ),
    "table_row_wise+projection+fp16": (
        ["--sharding_type", "table_row_wise", "--interaction_type", "projection", "--qcomm_backward_precision", "fp16"],
        "table_row_wise",
    ),
    "column_wise+plain loop+adagrad+int8": (
        [
            "--sharding_type",
            "column_wise",
            "--pipeline",
            "base",
            "--embedding_optimizer",
            "adagrad",
            "--qcomm_forward_precision",
            "int8",
            "--qcomm_backward_precision",
            "int8",
        ],
        "column_wise",
    ),
    "data_parallel": (["--sharding_type", "data_parallel"], "data_parallel"),
    "auto+sgd tables+sgd mlps": (
        [
            "--embedding_optimizer",
            "sgd",
            "--learning_rate",
            "2.0",
            "--dense_optimizer",
            "sgd",
            "--dense_learning_rate",
            "0.5",
        ],
        "table_wise",
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_and_reports(name, tmp_path, tiny_args):
    args, sharding = VARIANTS[name]
    summary_path = tmp_path / "summary.json"
    result = torchrun(["-m", "apps.dlrm.train", *tiny_args, "--output_dir", str(tmp_path), *args])
    assert_ok(result)
    summary = json.loads(summary_path.read_text())
    assert all(f": {sharding} (" in line for line in summary["sharding_plan"])
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert summary["val_auroc"] > 0.6  # random guessing scores 0.5
    assert summary["final_train_loss"] < 0.69  # below the loss of predicting 0.5
    assert (tmp_path / "tensorboard").is_dir()


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, message",
    [
        (["--qcomm_forward_precision", "fp8"], "--qcomm_forward_precision fp8 needs GPUs"),
        (["--embedding_optimizer", "adam"], "--embedding_optimizer adam needs GPUs"),
        (
            ["--sharding_type", "row_wise", "--qcomm_backward_precision", "int8"],
            "--qcomm_backward_precision int8 does not work with row_wise",
        ),
        (["--pipeline", "semi_sync"], "--pipeline semi_sync needs GPUs"),
        (["--pipeline", "fused_sparse_dist"], "--pipeline fused_sparse_dist needs GPUs"),
        (["--pipeline", "prefetch"], "--pipeline prefetch needs GPUs"),
        (["--compile_dense", "reduce-overhead"], "--compile_dense reduce-overhead replays CUDA graphs"),
    ],
)
def test_device_dependent_options_are_refused_on_cpu(args, message, capsys):
    """What the trainer checks before training (the command line, then its ranks' device): the
    refusal of one such option by a real run is below."""
    with pytest.raises((ConfigError, SystemExit)) as refused:
        check_device_support(parse_train_config([*TINY, *args]), "cpu")
    assert message in (capsys.readouterr().err if refused.type is SystemExit else str(refused.value))
    assert refused.type is ConfigError or refused.value.code == 2


def test_a_device_dependent_option_fails_before_training(tmp_path, tiny_args):
    args, message = ["--qcomm_forward_precision", "fp8"], "--qcomm_forward_precision fp8 needs GPUs"
    result = run([sys.executable, "-m", "apps.dlrm.train", *tiny_args, "--output_dir", str(tmp_path), *args])
    assert result.returncode == 2
    assert message in result.stderr
    assert "step 20/40" not in result.stderr
    assert not (tmp_path / "summary.json").exists()


def test_compiled_bf16_dense_part_learns_and_its_checkpoint_resumes_without_them(tmp_path, tiny_args):
    """--compile_dense and --dense_precision change how the dense part computes, not its
    parameters: a checkpoint saved with both resumes in a job without either."""
    ckpt = tmp_path / "ckpt"
    fast = ["--pipeline", "sparse_dist_lite", "--dense_precision", "bf16", "--compile_dense", "default"]
    result = torchrun(
        [
            "-m",
            "apps.dlrm.train",
            *tiny_args,
            "--output_dir",
            str(tmp_path / "fast"),
            "--checkpoint_dir",
            str(ckpt),
            *fast,
        ]
    )
    assert_ok(result)
    summary = json.loads((tmp_path / "fast" / "summary.json").read_text())
    assert summary["val_auroc"] > 0.6 and summary["final_train_loss"] < 0.69
    assert summary["config"]["compile_dense"] == "default"
    result = torchrun(
        [
            "-m",
            "apps.dlrm.train",
            *tiny(steps=60),
            "--output_dir",
            str(tmp_path / "plain"),
            "--checkpoint_dir",
            str(ckpt),
        ]
    )
    assert_ok(result)
    resumed = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 60


def test_each_forward_of_a_compiled_dense_part_is_one_cuda_graph_iteration(monkeypatch):
    """What lets CUDA graphs (--compile_dense reduce-overhead) through an evaluation (the GPU
    test below; on CPU the same path runs, compiled without graphs): each forward of the model,
    a training step or an evaluation batch, marks one iteration of CUDA graph trees, so that the
    three compiled parts of a forward are one (unmarked, each part of an evaluation batch began
    an iteration and freed the last part's output); evaluation hands its metrics copies."""
    marks = []
    mark = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: (marks.append(1), mark()))
    cfg = train_config(compile_dense="default", num_embeddings=100, batch_size=16)
    cpu = torch.device("cpu")
    model = build_model(cfg.model, cpu, table_device=cpu)
    speed_up_dense(cfg.launch, model, cpu)
    data = synthetic(cfg)
    loss, _ = model(next(data.train_batches()))
    loss.backward()
    assert len(marks) == 1
    model.eval()
    with torch.no_grad():
        first, second = (DLRM.eval_outputs(cfg, model, batch) for batch in data.eval_batches("val", 2))
    assert len(marks) == 3
    assert first[1].shape == (16,) and torch.isfinite(first[1]).all() and not torch.equal(first[1], second[1])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="--compile_dense reduce-overhead replays CUDA graphs: it needs a GPU"
)
def test_cuda_graphs_train_validate_test_and_checkpoint_on_one_gpu(tmp_path):
    """--compile_dense reduce-overhead on one GPU through validations between training steps (where
    it died on an H200: "accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run"), checkpoints, and the test of the best validation's checkpoint."""
    out, ckpt = tmp_path / "outputs", tmp_path / "ckpt"
    args = ["--steps", "300", "--val_every_steps", "100", "--checkpoint_every", "100", "--val_batches", "8"]
    result = run(
        [
            *LOCAL_TRAIN_1X2[:-1],
            "1x1",
            "--gpu",
            "1",
            "--compile_dense",
            "reduce-overhead",
            *args,
            "--output_dir",
            str(out),
            "--checkpoint_dir",
            str(ckpt),
        ],
        cwd=str(tmp_path),
        timeout=1200,
    )
    assert_ok(result)
    assert "job finished: SUCCEEDED" in result.stdout + result.stderr, result.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["config"]["compile_dense"] == "reduce-overhead"
    assert summary["steps"] == 300
    figures = ("val_auroc", "val_log_loss", "test_auroc", "test_log_loss", "best_val_auroc", "final_train_loss")
    assert all(math.isfinite(summary[name]) for name in figures), summary
    assert summary["val_auroc"] > 0.6 and summary["test_auroc"] > 0.6
    assert summary["test_step"] == summary["best_step"]  # the best validation's checkpoint, tested
    assert (ckpt / "step_00000300" / "COMMITTED").is_file()
