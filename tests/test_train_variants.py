"""Every sharding type, interaction, pipeline, comm precision and dense speed option trains on
CPU with gloo; the GPU-only ones are refused there before training."""

import json
import sys

import pytest

from apps.core.common.errors import ConfigError
from apps.core.training.device_support import check_device_support
from apps.dlrm.config import parse_train_config
from tests.conftest import TINY, assert_ok, run, tiny, torchrun

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
