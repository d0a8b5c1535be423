"""The GPU machine's version row (torch 2.11, fbgemm-gpu 1.6.0, torchrec 1.6.1 on Python 3.12) on
this CPU machine, as `make test-gpu-row` runs it: scripts/gpu_row.sh builds the row's venv (once:
minutes, ~5 GB) and runs on it the unit tier, the main job, a resume from its checkpoint and the
plan preview, and checks that what scripts/gpu_stage carries to the machine suffices there: its
one-part pack staged on an image like the machine's, where every step of the one-call GPU check
(scripts/gpu_stage/check.sh --on_cpu) runs."""

from tests.conftest import assert_ok, run

# Tier (tests/conftest.py): minutes; `make test-slow`.
TIER = "slow"


def test_the_gpu_machines_row_passes_on_this_machine():
    assert_ok(run(["bash", "scripts/gpu_row.sh"], timeout=3600))
