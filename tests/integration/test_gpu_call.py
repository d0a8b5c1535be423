"""The one device call that checks the GPU path (scripts/gpu_stage/check.sh, benchmarks/gpu_call.py),
here on CPU: every step's command line runs, quick, and what it writes reads as on the GPU; the
torchx jobs' exact GPU command lines pass ``torchx run --dryrun``; the UVM step's tables are ones
the planner caches; and a step that fails or outruns its limit is recorded while the others run."""

import json
import sys
import tarfile
from pathlib import Path

from benchmarks.gpu_call import TORCHX_RUN, Run, Step, Verdict, steps
from tests.conftest import assert_ok, run

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_every_step_runs_quick_on_cpu_and_comes_back_in_one_archive(tmp_path):
    out, work = tmp_path / "out", tmp_path / "steps"
    result = run(
        ["bash", "scripts/gpu_stage/check.sh", "--on_cpu"],
        GPU_STAGE_PACK="",  # this environment has the stack: nothing to stage
        OUT=str(out),
        GPU_CALL_DIR=str(work),
        timeout=600,
    )
    assert_ok(result)
    names = [step.name for step in steps(work)]
    done = records(out)
    assert sorted(r["step"] for r in done) == sorted(["dryrun", *names])
    assert all(r["ok"] for r in done), [r for r in done if not r["ok"]]
    assert sorted(path.name for path in out.iterdir()) == ["gpu_call.tar.gz", "steps.jsonl"]
    with tarfile.open(out / "gpu_call.tar.gz") as archive:
        packed = archive.getnames()
    assert {f"steps/{name}/log.txt" for name in names} <= set(packed)
    assert "steps/profile/trace.json" in packed and "steps/steps.jsonl" in packed
    assert not [name for name in packed if "/ckpt" in name]  # checkpoints stay out of the archive


def test_the_uvm_step_asks_for_tables_the_planner_caches_from_host_memory(tmp_path):
    uvm = next(step for step in steps(tmp_path) if step.name == "uvm_caching")
    args = uvm.argv[len(TORCHX_RUN) + 1 :]
    at = args.index("--output_dir")
    result = run([sys.executable, "-m", "apps.dlrm.plan", *args[:at], *args[at + 2 :]])
    assert_ok(result)
    assert "fused_uvm_caching" in result.stdout and "fits:" in result.stdout


def test_a_failing_or_slow_step_is_recorded_and_the_others_still_run(tmp_path):
    def wrote(folder: Path) -> Verdict:
        return Verdict(True, (folder / "figures.txt").read_text())

    # Its child in a session of its own, as torchx starts a job's processes, is ended too.
    in_own_session = (
        "import subprocess, time; subprocess.Popen(['sleep', '61.2345'], start_new_session=True); time.sleep(60)"
    )
    slow = Step("slow", ["python3", "-c", in_own_session], 2, wrote)
    failing = Step("failing", ["python3", "-c", "print('boom'); raise SystemExit(3)"], 30, wrote)
    writes = Step("writes", ["sh", "-c", f"echo 42 > {tmp_path / 'writes' / 'figures.txt'}"], 30, wrote)
    unread = Step("unread", ["true"], 30, wrote)
    checks = Run(tmp_path, budget_s=60, cpu=False)
    checks.together([slow, failing, writes, unread])
    by_step = {r["step"]: r for r in records(tmp_path)}
    assert by_step["slow"]["rc"] is None and by_step["slow"]["summary"].startswith("timed out after 2 s")
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if read(p) == "sleep\x0061.2345\x00"]
    assert by_step["failing"]["rc"] == 3 and by_step["failing"]["summary"] == "exited 3: boom"
    assert by_step["writes"]["ok"] and by_step["writes"]["summary"] == "42\n"
    assert not by_step["unread"]["ok"] and "results are unreadable: FileNotFoundError" in by_step["unread"]["summary"]


def test_out_of_budget_steps_are_not_started_and_the_archive_still_comes_back(tmp_path):
    out = tmp_path / "out"
    result = run(
        ["bash", "scripts/gpu_stage/check.sh", "--on_cpu", "--only", "main_job,loader"],
        GPU_STAGE_PACK="",
        GPU_CALL_BUDGET_S="10",
        OUT=str(out),
        GPU_CALL_DIR=str(tmp_path / "steps"),
    )
    assert result.returncode == 1
    done = {r["step"]: r["summary"] for r in records(out) if r["step"] != "dryrun"}
    assert sorted(done) == ["loader", "main_job"]
    assert all(summary.startswith("not run:") for summary in done.values()), done
    assert (out / "gpu_call.tar.gz").stat().st_size > 0
