"""A run on GPUs that gives no --batch_size gets a batch sized for a GPU (and the learning rates
measured with it), says so in one line, and its plan preview and --check_plan plan with it; a
--batch_size too big for the GPU's memory is refused before the job starts, naming the largest
that fits. Runs on CPU: the preview plans for GPUs of a given --hbm_gb."""

import logging
import re
import shlex

import pytest

from apps.core.config import with_device_defaults
from apps.core.launch.target import PlanTarget
from apps.dlrm.config import parse_train_config, train_config
from apps.dlrm.plan import main as plan_app
from apps.dlrm.plan import preview
from apps.hstu.config import train_config as hstu_config
from components import dlrm
from components.signature import InvalidComponentArgument

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

GPU_DEFAULTS = "batch_size 16384 per GPU (GPU default; --batch_size sets it)"
#: One GPU of 10 MiB and one table: its plan takes a fraction of a second, so a search over
#: batches does too, and a batch of a million samples does not fit.
SMALL_GPU = dict(num_sparse_features=1, hbm_gb=0.01)


def test_a_gpu_run_without_a_batch_size_gets_the_gpu_batch_and_says_so():
    cfg, said = with_device_defaults(train_config(steps=10), "cuda")
    assert (cfg.training.batch_size, cfg.training.steps) == (16384, 10)
    assert said == GPU_DEFAULTS
    assert with_device_defaults(cfg, "cuda") == (cfg, "")  # decided once
    cpu = train_config(steps=10)
    assert with_device_defaults(cpu, "cpu") == (cpu, "") and cpu.training.batch_size == 512


def test_a_batch_size_given_or_set_by_a_preset_is_kept_on_gpus():
    given = parse_train_config(["--batch_size", "512"])  # the default's value, but given
    assert with_device_defaults(given, "cuda") == (given, "")
    preset = train_config(preset="dlrmv2")
    assert with_device_defaults(preset, "cuda")[0].training.batch_size == 8192
    # what the component hands the app: the options that differ from their defaults
    assert app_args(j="1x1", gpu=1, batch_size=1024) == ["--batch_size", "1024"]
    assert app_args(j="1x1", gpu=1) == []  # nothing given: the trainer decides on its device


def app_args(**component_args) -> list[str]:
    """The options the training component hands ``python -m apps.dlrm.train``."""
    cmd = shlex.split(dlrm.train(**component_args).roles[0].args[1])
    return cmd[cmd.index("apps.dlrm.train") + 1 :]


def test_the_hstu_keeps_its_batch_on_gpus():
    cfg = hstu_config()
    assert with_device_defaults(cfg, "cuda") == (cfg, "") and cfg.training.batch_size == 128


def test_the_preview_of_gpu_ranks_plans_with_the_gpu_batch_and_says_so(capsys):
    for argv, batch, note in (([], 16384, [GPU_DEFAULTS]), (["--batch_size", "512"], 512, [])):
        with pytest.raises(SystemExit) as exit:
            plan_app(["-j", "1x1", "--gpu", "1", "--hbm_gb", "8", *argv])
        assert exit.value.code == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith(f", batch {batch} per rank")
        assert out[2 : 2 + len(note)] == note and out[2 + len(note)] == ""


def test_check_plan_plans_a_gpu_job_with_the_batch_it_will_train_with(caplog):
    with caplog.at_level(logging.INFO, logger="components.plan_check"):
        dlrm.train(check_plan=True, j="1x1", gpu=1, hbm_gb=8)
    said = [r.getMessage() for r in caplog.records if r.name == "components.plan_check"]
    assert said[0] == f"--check_plan: {GPU_DEFAULTS}" and said[1].startswith("--check_plan: fits: ")


def test_check_plan_refuses_a_batch_too_big_for_the_gpu_naming_the_largest_that_fits():
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(check_plan=True, j="1x1", gpu=1, batch_size=1_000_000, **SMALL_GPU)
    named = re.fullmatch(
        r"--check_plan: does not fit: needs \d+\.\d\d GiB HBM on rank 0, has 0\.01 GiB .*; --batch_size (\d+) is the "
        r"largest that fits \(this is 1000000\): give that or less, or use more ranks \(-j\), .*",
        str(error.value),
    )
    assert named, str(error.value)
    largest, target = int(named[1]), PlanTarget(j="1x1", gpu=1, hbm_gb=SMALL_GPU["hbm_gb"])
    assert preview(train_config(batch_size=largest, **SMALL_GPU), target.cluster).fits
    assert not preview(train_config(batch_size=largest + 1, **SMALL_GPU), target.cluster).fits


def test_tables_too_big_for_any_batch_are_not_told_to_shrink_the_batch():
    # 200M rows of 16 floats: 12 GiB, cached from 8 GiB of host memory neither
    result = preview(
        train_config(batch_size=2, num_embeddings=200_000_000, **SMALL_GPU),
        PlanTarget(j="1x1", gpu=1, hbm_gb=0.01).cluster,
    )
    assert not result.fits and result.largest_batch == 0
    assert "--batch_size" not in result.verdict()
