"""The GPU path checked in one device call of a lent GPU machine: the steps that
scripts/gpu_stage/check.sh runs there once the stack is staged, each with its own time limit.

    python3 -m benchmarks.gpu_call --out DIR --budget_s 500     # there (check.sh runs it)
    python3 -m benchmarks.gpu_call --out DIR --on_cpu           # here: every command line, quick, on CPU

First the correctness steps, at once (the machine has 16 cores and one GPU of 139 GiB): the main
job, the HSTU, the main job with managed-collision tables (--categorical_ids zch, and --zch_columns
for some), CUDA graphs (--compile_dense reduce-overhead) through validation, test and checkpoints,
tables cached from host memory (a small --hbm_gb: fused_uvm_caching), and sharded = unsharded
equivalence, and the gpu-tier tests (the whole step's CUDA graph). Then, each alone so that its
figures are the machine's: the loader into the GPU, a profile of 20 steady training steps, and the
throughput rows (the app against plain TorchRec at reference document 002's model, in the same run).

Each step writes its output under DIR/<step>/ (its log in log.txt) and, as soon as it ends, one
JSON line to DIR/steps.jsonl and to stdout: its verdict, exit status, seconds, a one-line summary
and its figures. A step that fails or runs out of time is recorded and the next one runs. No step
outlives --budget_s: each gets the lesser of its own limit and what is left.

--on_cpu is the check of the command lines before GPU time is spent on them: each step runs on
CPU, quick (few steps, small tables: the step's ``quick`` options), with
its GPU-only options swapped for CPU ones (:data:`ON_CPU`), all steps at once; the torchx jobs'
exact GPU command lines are also built by ``torchx run --dryrun``, which parses and checks every
option as the job would. There a step is ok when it ran and what it wrote reads as on a GPU (a
few CPU steps learn nothing, so the GPU's verdicts would not hold). The exit status is 0 when every
step is ok, else 1.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from xml.etree import ElementTree

from benchmarks.gpu_check import AUROC_MARGIN

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHX_RUN = [PY, "-m", "torchx.cli.main", "run", "-s", "local_cwd"]  # no `torchx` script there
ONE_GPU = ["-j", "1x1", "--gpu", "1"]
#: A DLRM job's options for a quick CPU run.
QUICK_JOB = ["--steps", "6", "--val_batches", "2", "--test_batches", "2", "--log_every", "3"]
#: Reference document 002's model at a size a CPU builds in seconds.
QUICK_MODEL = ["--num_embeddings", "1000", "--batch_size", "128"]
#: GPU-only options and what --on_cpu runs instead: (option, its GPU value or None for any) ->
#: the CPU's replacement (nothing: the option is dropped with its value).
ON_CPU: dict[tuple[str, str | None], list[str]] = {
    ("--gpu", None): [],
    ("--hbm_gb", None): [],
    ("--compile_dense", "reduce-overhead"): ["--compile_dense", "none"],
    ("--device", "cuda"): ["--device", "cpu"],
}
#: Seconds kept back from the budget for the last step's record and the archive.
RESERVE_S = 5
#: The least time worth starting a step with (unless its own limit is less).
MIN_STEP_S = 20


@dataclass
class Verdict:
    ok: bool
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One command of the check: ``argv`` runs in the repository with the step's folder made."""

    name: str
    argv: list[str]
    limit_s: int
    read: Callable[[Path], Verdict]  # the verdict from the step's folder, once it exited 0
    quick: list[str] = field(default_factory=list)  # appended on CPU
    alone: bool = False  # after the others, by itself

    @property
    def is_torchx_job(self) -> bool:
        return self.argv[: len(TORCHX_RUN)] == TORCHX_RUN


def on_cpu(step: Step) -> list[str]:
    """The step's command line as --on_cpu runs it: GPU-only options swapped, quick options set
    (each replaces the option's value where the line has it: torchx refuses an option given
    twice), and the quick options after a ``--`` appended."""
    argv, i = [], 0
    while i < len(step.argv):
        option, value = step.argv[i], step.argv[i + 1] if i + 1 < len(step.argv) else ""
        swap = ON_CPU.get((option, None), ON_CPU.get((option, value)))
        argv += [option] if swap is None else swap
        i += 1 if swap is None else 2
    quick = step.quick
    ends = quick.index("--") if "--" in quick else len(quick)
    for option, value in zip(quick[:ends:2], quick[1:ends:2]):
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    return argv + quick[ends:]


def dryrun(step: Step) -> list[str]:
    """``torchx run --dryrun`` of a torchx job's exact command line."""
    return [*TORCHX_RUN[:-2], "--dryrun", *step.argv[len(TORCHX_RUN) - 2 :]]


# What each step's output says.


def summary_of(folder: Path) -> dict[str, Any]:
    with open(folder / "run" / "summary.json") as f:
        return json.load(f)


def kernels_of(summary: dict[str, Any]) -> list[str]:
    """The compute kernels of a run's plan ("t_cat_0: table_wise (fused) on ranks 0")."""
    return sorted({line.split("(")[1].split(")")[0] for line in summary["sharding_plan"]})


def click_job(summary: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
    """Whether a DLRM job learned (validation AUROC within AUROC_MARGIN of the synthetic data's
    ceiling), a line saying so, and its figures."""
    learned = summary["val_auroc"] >= summary["auroc_ceiling"] - AUROC_MARGIN
    peak = summary["peak_hbm_bytes"]
    figures = {
        key: summary[key]
        for key in ("val_auroc", "auroc_ceiling", "test_auroc", "samples_per_sec", "steps", "global_batch_size")
    }
    figures.update(kernels=kernels_of(summary), peak_hbm_gib=peak / 2**30 if peak else None)
    line = (
        f"val AUROC {summary['val_auroc']:.4f} (ceiling {summary['auroc_ceiling']:.4f}), "
        f"{summary['steps']} steps of {summary['global_batch_size']}, {summary['samples_per_sec']:,.0f} samples/s"
        + (f", peak HBM {peak / 2**30:.2f} GiB" if peak else "")
    )
    return learned, line, figures


def read_main_job(folder: Path) -> Verdict:
    return Verdict(*click_job(summary_of(folder)))


def read_cuda_graphs(folder: Path) -> Verdict:
    """Learned, and validated more than once between training steps, tested, checkpointed."""
    learned, line, figures = click_job(summary_of(folder))
    with open(folder / "run" / "metrics.jsonl") as f:
        kinds = [json.loads(line)["kind"] for line in f]
    checkpoints = sorted(p.name for p in (folder / "ckpt").glob("step_*") if (p / "COMMITTED").exists())
    figures.update(validations=kinds.count("val"), tests=kinds.count("test"), checkpoints=checkpoints)
    ok = learned and kinds.count("val") >= 2 and kinds.count("test") == 1 and bool(checkpoints)
    return Verdict(ok, f"{line}; {kinds.count('val')} validations, test, checkpoints {checkpoints}", figures)


def read_uvm(folder: Path) -> Verdict:
    """Learned, with tables that the planner cached from host memory (fused_uvm_caching)."""
    learned, line, figures = click_job(summary_of(folder))
    cached = "fused_uvm_caching" in figures["kernels"]
    return Verdict(learned and cached, f"kernels {','.join(figures['kernels'])}; {line}", figures)


def read_hstu(folder: Path) -> Verdict:
    """Trained and evaluated: every validation metric beside its synthetic ceiling."""
    summary = summary_of(folder)
    metrics = {
        name[4:]: (value, summary.get(f"{name[4:]}_ceiling"))
        for name, value in summary.items()
        if name.startswith("val_")
    }
    finite = all(math.isfinite(value) for value, _ in metrics.values())
    line = ", ".join(
        f"val {m} {value:.4f}" + (f" (ceiling {ceiling:.4f})" if ceiling is not None else "")
        for m, (value, ceiling) in sorted(metrics.items())
    )
    figures = {"val": metrics, "samples_per_sec": summary["samples_per_sec"], "steps": summary["steps"]}
    return Verdict(finite, f"{line}; {summary['steps']} steps, {summary['samples_per_sec']:,.0f} samples/s", figures)


def read_json(folder: Path, name: str) -> Any:
    with open(folder / name) as f:
        return json.load(f)


def read_equivalence(folder: Path) -> Verdict:
    results = read_json(folder, "equivalence.json")
    worst = max(r["max_difference"] for r in results)
    unequal = [r["sharding_type"] for r in results if not r["equal"]]
    types = ",".join(r["sharding_type"] for r in results)
    return Verdict(
        not unequal,
        f"{types}: max loss difference {worst:.1e}" + (f"; UNEQUAL: {','.join(unequal)}" if unequal else ""),
        {"results": results},
    )


def read_gpu_tests(folder: Path) -> Verdict:
    """The gpu-tier tests' verdict from pytest's JUnit report: ok when some ran and none failed
    (all skipped means nothing was checked: not ok on a GPU)."""
    suite = ElementTree.parse(folder / "junit.xml").getroot().find("testsuite")
    assert suite is not None, "junit.xml has no testsuite"
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    return Verdict(
        ran > 0 and not bad, f"{ran - bad} of {ran} gpu-tier tests passed, {counts['skipped']} skipped", counts
    )


def read_loader(folder: Path) -> Verdict:
    r = read_json(folder, "loader.json")
    return Verdict(True, f"{r['train_samples_per_sec']:,.0f} samples/s into {r.get('device', 'the device')}", r)


def read_profile(folder: Path) -> Verdict:
    r = read_json(folder, "profile.json")
    top = r["top"][0]
    busy = f"GPU busy {r['gpu_busy_fraction']:.0%} of wall, " if "gpu_busy_fraction" in r else ""
    tf32 = f"tf32 kernels {r['tf32_kernel_share']:.0%} of kernel time, " if "tf32_kernel_share" in r else ""
    return Verdict(
        True,
        f"{r['steps']} steps {r['wall_s'] * 1e3:.0f} ms, {busy}{tf32}allow_tf32={r['tf32']['matmul.allow_tf32']}; "
        f"top {top['share']:.0%} {top['name'][:60]}",
        r,
    )


def read_throughput(folder: Path) -> Verdict:
    r = read_json(folder, "throughput.json")
    rows = "; ".join(f"{row['config']} {row['samples_per_sec']:,.0f}/s ({row['ratio']:.2f}x)" for row in r["rows"])
    return Verdict(r["target_met"], f"{rows}; target {r['target']}: {'met' if r['target_met'] else 'NOT met'}", r)


def steps(out: Path) -> list[Step]:
    """The check's steps, writing under ``out``, in the order they start."""

    def at(name: str, *path: str) -> str:
        return str(out.joinpath(name, *path))

    dlrm, hstu = [*TORCHX_RUN, "components.dlrm:train", *ONE_GPU], [*TORCHX_RUN, "components.hstu:train", *ONE_GPU]
    return [
        Step("main_job", [*dlrm, "--output_dir", at("main_job", "run")], 240, read_main_job, QUICK_JOB),
        Step("hstu", [*hstu, "--output_dir", at("hstu", "run")], 240, read_hstu, QUICK_JOB),
        # Managed-collision tables (TorchRec's MC-EBC, row-wise) on the GPU: FBGEMM's CUDA reset
        # of a row that changes hands, where the CPU runs the host reset.
        Step(
            "zch",
            [*dlrm, "--categorical_ids", "zch", "--output_dir", at("zch", "run")],
            240,
            read_main_job,
            QUICK_JOB,
        ),
        # Some columns managed (row-wise) beside plain tables, which the GPU's planner places with
        # them in one plan (a CPU plans each collection apart).
        Step(
            "zch_columns",
            [*dlrm, "--zch_columns", "cat_0,cat_1,cat_2", "--output_dir", at("zch_columns", "run")],
            240,
            read_main_job,
            QUICK_JOB,
        ),
        Step(
            "cuda_graphs",
            [
                *dlrm,
                "--compile_dense",
                "reduce-overhead",
                *("--steps", "1500", "--val_every_steps", "500", "--checkpoint_every", "750"),
                *("--checkpoint_dir", at("cuda_graphs", "ckpt"), "--output_dir", at("cuda_graphs", "run")),
            ],
            240,
            read_cuda_graphs,
            [*QUICK_JOB, "--val_every_steps", "3", "--checkpoint_every", "3"],
        ),
        # The gpu-tier tests: the whole step's CUDA graph against eager, step for step, and a
        # job with it that resumes; --compile_dense reduce-overhead through validation.
        Step(
            "gpu_tests",
            [
                *(PY, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider"),
                *("tests/unit/test_step_graph.py", "tests/integration/test_train_variants.py"),
                *("--junitxml", at("gpu_tests", "junit.xml")),
            ],
            240,
            read_gpu_tests,
        ),
        # Tables of 26 x 500k x 16 (0.83 GB) with 0.5 GiB of HBM: the planner caches most of them
        # (tests/integration/test_gpu_call.py previews the plan).
        Step(
            "uvm_caching",
            [*dlrm, "--num_embeddings", "500000", "--hbm_gb", "0.5", "--output_dir", at("uvm_caching", "run")],
            240,
            read_uvm,
            [*QUICK_JOB, "--num_embeddings", "1000"],
        ),
        Step(
            "equivalence",
            [PY, "benchmarks/equivalence.py", "--nproc", "1", "--json", at("equivalence", "equivalence.json")],
            240,
            read_equivalence,
            ["--sharding_types", "table_wise"],
        ),
        Step(
            "loader",
            [
                PY,
                "benchmarks/criteo_loader.py",
                *("--device", "cuda", "--rows", "4000000", "--batch_size", "16384", "--repeats", "2"),
                *("--json", at("loader", "loader.json")),
            ],
            90,
            read_loader,
            ["--rows", "20000", "--batch_size", "1024", "--repeats", "1"],
            alone=True,
        ),
        Step(
            "profile",
            [
                PY,
                "benchmarks/train_profile.py",
                *("--preset", "h100", "--warmup", "30", "--steps", "20"),
                *("--json", at("profile", "profile.json"), "--trace", at("profile", "trace.json")),
            ],
            120,
            read_profile,
            ["--warmup", "2", "--steps", "2", "--", *QUICK_MODEL],
            alone=True,
        ),
        Step(
            "throughput",
            [
                PY,
                "benchmarks/train_throughput.py",
                *("--preset", "h100", "--nproc", "1", "--repeats", "2"),
                *("--json", at("throughput", "throughput.json")),
            ],
            200,
            read_throughput,
            ["--repeats", "1", "--window", "2", "--", *QUICK_MODEL, "--steps", "4"],
            alone=True,
        ),
    ]


class Run:
    """The steps' processes, their deadlines and their records."""

    def __init__(self, out: Path, budget_s: float, cpu: bool) -> None:
        self.out, self.cpu = out, cpu
        self.end = time.monotonic() + budget_s - RESERVE_S
        self.records: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.end - time.monotonic()

    def record(self, step: str, ok: bool, summary: str, **details: Any) -> None:
        record = {"step": step, "ok": ok, "summary": summary, **details}
        self.records.append(record)
        line = json.dumps(record)
        with open(self.out / "steps.jsonl", "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    def start(self, step: Step) -> tuple[subprocess.Popen, float, list[str], float] | None:
        """Starts the step (its own process group, so that a timeout ends all it started)."""
        limit = min(step.limit_s, self.left())
        if limit < min(step.limit_s, MIN_STEP_S):
            self.record(step.name, False, f"not run: only {max(0, self.left()):.0f} s of the budget left", rc=None)
            return None
        argv = on_cpu(step) if self.cpu else step.argv
        (self.out / step.name).mkdir(parents=True, exist_ok=True)
        log = open(self.out / step.name / "log.txt", "w")
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return proc, time.monotonic(), argv, limit

    def finish(self, step: Step, rc: int | None, started: float, argv: list[str], limit: float) -> None:
        """Records the step: its exit status (None: timed out) and what its output says."""
        details = {"rc": rc, "seconds": round(time.monotonic() - started, 1), "limit_s": round(limit), "argv": argv}
        if rc is None:
            self.record(step.name, False, f"timed out after {limit:.0f} s: see {step.name}/log.txt", **details)
        elif rc != 0:
            self.record(step.name, False, f"exited {rc}: {last_line(self.out / step.name / 'log.txt')}", **details)
        else:
            try:
                verdict = step.read(self.out / step.name)
            except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
                verdict = Verdict(False, f"exited 0 but its results are unreadable: {type(e).__name__}: {e}")
            else:
                verdict.ok = verdict.ok or self.cpu  # on CPU: it ran, and what it wrote reads
            self.record(step.name, verdict.ok, verdict.summary, figures=verdict.figures, **details)

    def together(self, group: list[Step]) -> None:
        """Runs the steps at once; records each as it ends, or ends it (and all it started) at
        its deadline."""
        running = {step.name: (step, handle) for step in group if (handle := self.start(step))}
        while running:
            for name, (step, (proc, started, argv, limit)) in list(running.items()):
                rc = proc.poll()
                if rc is None and time.monotonic() < started + limit:
                    continue
                if rc is None:
                    end_tree(proc)
                del running[name]
                self.finish(step, rc, started, argv, limit)
            time.sleep(0.5)

    def dryruns(self, jobs: list[Step]) -> None:
        """--on_cpu: ``torchx run --dryrun`` of every torchx job's exact GPU command line."""
        failed = []
        for step in jobs:
            result = subprocess.run(dryrun(step), cwd=REPO, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                failed.append(f"{step.name}: {(result.stdout + result.stderr).strip().splitlines()[-1:]}")
        self.record(
            "dryrun", not failed, "; ".join(failed) or f"torchx accepts the GPU command lines of {len(jobs)} jobs"
        )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's /proc), those in sessions of their own too: torchx's
    local scheduler starts each job so, out of reach of its launcher's process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def end_tree(proc: subprocess.Popen) -> None:
    """Kills a step that outran its limit, with every process it started."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_call", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the folder the steps write into (made if missing)")
    parser.add_argument("--budget_s", type=float, default=500, help="seconds for all steps together")
    parser.add_argument("--on_cpu", action="store_true", help="check every step's command line, quick, on CPU")
    parser.add_argument("--only", default="", help="some steps, comma separated (default: all)")
    opts = parser.parse_args(argv)
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = steps(out)
    if opts.only:
        names = opts.only.split(",")
        unknown = sorted(set(names) - {s.name for s in chosen})
        if unknown:
            parser.error(f"--only {','.join(unknown)}: no such step; use some of {','.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in names]
    run = Run(out, opts.budget_s, opts.on_cpu)
    if opts.on_cpu:
        run.dryruns([s for s in chosen if s.is_torchx_job])
    if opts.on_cpu:  # no figure of the machine's to protect: all at once
        run.together(chosen)
    else:
        run.together([s for s in chosen if not s.alone])
        for step in (s for s in chosen if s.alone):
            run.together([step])
    passed = sum(r["ok"] for r in run.records)
    print(f"gpu_call: {passed} of {len(run.records)} steps ok; each in {out}/steps.jsonl and {out}/<step>/log.txt")
    sys.exit(0 if passed == len(run.records) else 1)


if __name__ == "__main__":
    main()
