"""Every sharding type, interaction, pipeline and comm precision trains on CPU with gloo."""

import json
import sys

import pytest

from tests.conftest import assert_ok, run, torchrun

VARIANTS = {
    "table_wise+fp16/bf16+validate_every": (
        ["--sharding_type", "table_wise", "--qcomm_forward_precision", "fp16",
         "--qcomm_backward_precision", "bf16", "--validate_every", "20"], "table_wise"),
    "row_wise+dcn+bf16": (
        ["--sharding_type", "row_wise", "--interaction_type", "dcn", "--qcomm_forward_precision", "bf16"],
        "row_wise"),
    "table_row_wise+projection+fp16": (
        ["--sharding_type", "table_row_wise", "--interaction_type", "projection",
         "--qcomm_backward_precision", "fp16"], "table_row_wise"),
    "column_wise+plain loop+adagrad+int8": (
        ["--sharding_type", "column_wise", "--pipeline", "base", "--embedding_optimizer", "adagrad",
         "--qcomm_forward_precision", "int8", "--qcomm_backward_precision", "int8"], "column_wise"),
    "data_parallel": (["--sharding_type", "data_parallel"], "data_parallel"),
    "auto+sgd tables+sgd mlps": (
        ["--embedding_optimizer", "sgd", "--learning_rate", "2.0", "--dense_optimizer", "sgd",
         "--dense_learning_rate", "0.5"], "table_wise"),
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--qcomm_forward_precision", "fp8"], "--qcomm_forward_precision fp8 needs GPUs"),
        (["--embedding_optimizer", "adam"], "--embedding_optimizer adam needs GPUs"),
        (["--sharding_type", "row_wise", "--qcomm_backward_precision", "int8"],
         "--qcomm_backward_precision int8 does not work with row_wise"),
    ],
)
def test_device_dependent_options_fail_before_training(args, message, tmp_path, tiny_args):
    result = run([sys.executable, "-m", "apps.dlrm.train", *tiny_args, "--output_dir", str(tmp_path), *args])
    assert result.returncode == 2
    assert message in result.stderr
    assert "step 20/40" not in result.stderr
    assert not (tmp_path / "summary.json").exists()
