"""The one-command GPU check (benchmarks/gpu_check.py): what can be checked without a GPU here,
and the check itself on a GPU machine."""

import json
import subprocess
import sys

import pytest
import torch

from apps.core.training.plan import DOES_NOT_FIT
from benchmarks import gpu_check
from benchmarks.gpu_check import CHECKS, Check, gib_text, largest_rows, parse_names, plan_in_hbm, render
from tests.conftest import assert_ok, run

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU check needs an NVIDIA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    result = run([sys.executable, "-m", "benchmarks.gpu_check"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False): run it on a "
        "GPU machine after `make install`"
    ]


@pytest.mark.unit
def test_only_runs_the_named_checks_in_their_order_and_refuses_unknown_ones():
    assert parse_names("") == list(CHECKS)
    assert parse_names("memory,main_job") == ["main_job", "memory"]
    result = run([sys.executable, "-m", "benchmarks.gpu_check", "--only", "main_job,speed"])
    assert result.returncode == 2
    assert "--only: no such check: speed; use some of main_job,equivalence," in result.stderr


@pytest.mark.unit
def test_the_table_names_every_check_and_its_verdict():
    table = render([Check("main job", True, "val AUROC 0.79"), Check("comms fp8", False, "error: boom")])
    assert table.splitlines() == ["main job   ok      val AUROC 0.79", "comms fp8  FAILED  error: boom"]


def test_the_memory_check_sizes_tables_to_the_planners_own_limit():
    """The largest tables the planner places in one GPU's HBM: one step more and it caches them."""
    rows = largest_rows(8.0)
    assert 0 < rows * 26 * 128 * 4 < 8 * 2**30  # some tables, and less than the whole GPU
    assert plan_in_hbm(rows, 8.0) and not plan_in_hbm(rows + 250_000, 8.0)
    assert gib_text(79.2549) == "79.25"


def plan_app_ends(monkeypatch, returncode: int, stdout: str = "", stderr: str = "") -> None:
    """The plan preview that gpu_check starts ends so, without running."""
    ended = subprocess.CompletedProcess([], returncode, stdout, stderr)
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: ended)


@pytest.mark.unit
@pytest.mark.parametrize(
    "returncode, verdict, in_hbm",
    [
        (0, "t_cat_0 ... fused ...\nfits: at most 6.18 GiB", True),
        (0, "t_cat_0 ... fused_uvm_caching ...\nfits: at most 6.18 GiB", False),  # fits, not in HBM
        (DOES_NOT_FIT, "does not fit: needs 9.12 GiB HBM on rank 0, has 6.80 GiB", False),
    ],
)
def test_the_memory_check_reads_the_plan_apps_verdict(monkeypatch, returncode, verdict, in_hbm):
    plan_app_ends(monkeypatch, returncode, verdict)
    assert plan_in_hbm(1_000_000, 8.0) is in_hbm


@pytest.mark.unit
def test_a_crashed_plan_preview_fails_the_memory_check_instead_of_reading_as_does_not_fit(monkeypatch):
    # A traceback exits 1: read as "does not fit", it made the search answer 0 rows.
    crash = "Traceback (most recent call last):\nTypeError: _compute_storage() takes 1 positional argument"
    plan_app_ends(monkeypatch, 1, stderr=crash)
    with pytest.raises(RuntimeError, match=r"failed with exit 1, not a verdict.*\n.*takes 1 positional argument"):
        largest_rows(8.0)


@pytest.mark.gpu
@needs_gpu
def test_the_gpu_check_passes_on_this_gpu_machine(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--only",
            "main_job,equivalence,precisions",
            "--output",
            str(out),
        ],
        timeout=1800,
    )
    assert_ok(result)
    checks = json.loads(out.read_text())["checks"]
    assert checks and all(check["ok"] for check in checks), checks
