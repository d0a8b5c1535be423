"""Checks and measures a machine with NVIDIA GPUs in one command.

    make gpu-check                                   # python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --only main_job,equivalence --output check.json

Runs, on every GPU this process sees (NCCL between them):

- main_job: ``torchx run -s local_cwd components.dlrm:train -j 1xN --gpu N``, as a user does:
  its validation AUROC against the synthetic data's ceiling, and samples/s;
- equivalence: sharded = unsharded training, float32 with TF32 off, for every sharding type
  (benchmarks/equivalence.py);
- checkpoint: a save, a load and a load resharded to row_wise, with GB/s against raw file I/O
  (benchmarks/checkpoint_io.py);
- precisions: fp16, bf16, int8 and fp8 quantized all-to-all comms and fused Adam, which CPUs
  refuse: each a short training job that must learn;
- throughput: benchmarks/train_throughput.py --preset h100 with every speed lever, against plain
  TorchRec in the same run (target: ratio >= 1.5 and >= 4M samples/s on one H100);
- step_overhead: one rank's host time and operators per step at tiny shapes, the lean step, the
  sharded one and plain TorchRec (benchmarks/step_overhead.py; a measurement, no target on GPUs);
- loader: the Criteo loader's samples/s into the GPU (pinned memory, non-blocking copies),
  which must exceed the best training rate measured above;
- memory: the largest tables (26 x rows x 128) TorchRec's planner places in one GPU's HBM, and
  the same tables with a quarter of the HBM, where the planner caches them from host memory
  (fused_uvm_caching); each trained, with its peak HBM against the planner's estimate.

Prints a table and writes it as JSON to --output (default: $OUT_DIR/gpu_check.json, or
./gpu_check.json). Exits 2 on a machine without a GPU, 1 if any check failed. A device lease
limits one command to 10 minutes: --only runs some checks (in the order above).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
#: The model of reference document 002, as in train_throughput's h100 preset.
TABLES, DIM = 26, 128
#: An AUROC this close to the synthetic data's ceiling means the job learned.
AUROC_MARGIN = 0.05


@dataclass
class Check:
    name: str
    ok: bool
    summary: str  # one line of figures, for the table
    figures: dict = field(default_factory=dict)  # the same, and more, for the JSON


@dataclass
class Machine:
    """What the checks run on, and what earlier checks measured that later ones compare with."""

    gpus: int
    workdir: str
    best_training_rate: float = 0.0  # samples/s per GPU, the best the throughput check saw

    def python(self, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        """Runs ``python ARGS`` in the repository; a failure raises with the end of its stderr."""
        result = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"`python {' '.join(args)}` exited {result.returncode}: {result.stderr[-3000:]}")
        return result

    def json_of(self, script: str, *args: str) -> object:
        """Runs a benchmark script with ``--json FILE`` and gives back what it wrote."""
        path = os.path.join(self.workdir, f"{os.path.basename(script)}.json")
        self.python(os.path.join(BENCHMARKS, script), *args, "--json", path)
        with open(path) as f:
            return json.load(f)

    def train(self, name: str, *app_args: str, nproc: int | None = None) -> dict:
        """A training job of ``nproc`` ranks (all GPUs); its summary.json."""
        out = os.path.join(self.workdir, name)
        self.python(
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc or self.gpus),
            "-m",
            "apps.dlrm.train",
            *app_args,
            "--output_dir",
            out,
        )
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)


def learned(summary: dict) -> bool:
    return summary["val_auroc"] >= summary["auroc_ceiling"] - AUROC_MARGIN


def check_main_job(machine: Machine) -> list[Check]:
    out = os.path.join(machine.workdir, "main_job")
    n = str(machine.gpus)
    result = subprocess.run(
        [
            # torchx's CLI as a module: the GPU machine has torchx on PYTHONPATH (staged), and
            # no `torchx` script beside its python.
            sys.executable,
            "-m",
            "torchx.cli.main",
            "run",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            "-j",
            f"1x{n}",
            "--gpu",
            n,
            "--output_dir",
            out,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"torchx run exited {result.returncode}: {(result.stdout + result.stderr)[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return [
        Check(
            "main job",
            learned(s),
            f"val AUROC {s['val_auroc']:.4f} (ceiling {s['auroc_ceiling']:.4f}), "
            f"{s['samples_per_sec']:,.0f} samples/s on {n} GPUs",
            {k: s[k] for k in ("val_auroc", "auroc_ceiling", "test_auroc", "samples_per_sec", "world_size")},
        )
    ]


def check_equivalence(machine: Machine) -> list[Check]:
    path = os.path.join(machine.workdir, "equivalence.json")
    subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "equivalence.py"), "--nproc", str(machine.gpus), "--json", path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if not os.path.exists(path):
        raise RuntimeError("benchmarks/equivalence.py wrote no results: run it alone to see why")
    with open(path) as f:
        results = json.load(f)
    return [
        Check(
            f"equivalence {r['sharding_type']}",
            r["equal"],
            f"max loss difference {r['max_difference']:.1e} over {len(r['sharded'])} steps, {r['world_size']} GPUs",
            r,
        )
        for r in results
    ]


def check_checkpoint(machine: Machine) -> list[Check]:
    results = machine.json_of(
        "checkpoint_io.py",
        "--targets",
        "local",
        "--nproc",
        str(machine.gpus),
        "--rows",
        "4000000",
        "--reshard_to",
        "row_wise",
    )
    r = results["local"]
    return [
        Check(
            "checkpoint",
            bool(r["reshard_equal"]),
            f"{r['gb']:.2f} GB: save {r['save_gbps']:.2f} GB/s ({r['save_ratio']:.2f}x raw), "
            f"load {r['load_gbps']:.2f} GB/s ({r['load_ratio']:.2f}x raw), resharded to "
            f"{r['reshard_to']} {r['reshard_load_gbps']:.2f} GB/s, equal: {r['reshard_equal']}",
            r,
        )
    ]


#: Short jobs of what CPUs refuse (and the quantized comms they allow), each of which must learn.
PRECISION_JOBS = {
    "comms fp16": ["--qcomm_forward_precision", "fp16", "--qcomm_backward_precision", "fp16"],
    "comms bf16": ["--qcomm_forward_precision", "bf16", "--qcomm_backward_precision", "bf16"],
    "comms int8": ["--qcomm_forward_precision", "int8", "--qcomm_backward_precision", "bf16"],
    "comms fp8": ["--qcomm_forward_precision", "fp8", "--qcomm_backward_precision", "fp8"],
    "fused Adam": ["--embedding_optimizer", "adam", "--learning_rate", "0.001"],
}


def check_precisions(machine: Machine) -> list[Check]:
    checks = []
    for name, args in PRECISION_JOBS.items():
        s = machine.train(name.replace(" ", "_"), *args, "--sharding_type", "table_wise")
        checks.append(
            Check(
                name,
                learned(s),
                f"val AUROC {s['val_auroc']:.4f} (ceiling {s['auroc_ceiling']:.4f}), "
                f"{s['samples_per_sec']:,.0f} samples/s",
                {
                    "args": args,
                    "val_auroc": s["val_auroc"],
                    "auroc_ceiling": s["auroc_ceiling"],
                    "samples_per_sec": s["samples_per_sec"],
                },
            )
        )
    return checks


def check_throughput(machine: Machine) -> list[Check]:
    r = machine.json_of(
        "train_throughput.py", "--preset", "h100", "--nproc", str(machine.gpus), "--levers", "all", "--repeats", "1"
    )
    best = max(r["rows"][1:], key=lambda row: row["samples_per_sec"])
    machine.best_training_rate = best["samples_per_sec"] / machine.gpus
    rows = [
        Check(
            f"throughput {row['config']}",
            True,
            f"{row['samples_per_sec']:,.0f} samples/s, {row['ratio']:.2f}x plain TorchRec",
            row,
        )
        for row in r["rows"]
    ]
    return rows + [
        Check(
            "throughput target",
            r["target_met"],
            f"best {r['best']} at {best['ratio']:.2f}x, {best['samples_per_sec']:,.0f} samples/s; target {r['target']}",
            r,
        )
    ]


def check_step_overhead(machine: Machine) -> list[Check]:
    r = machine.json_of("step_overhead.py")
    host = ", ".join(
        f"{side} {m['host_ms_per_step']:.3f} ms ({m['ops_per_step']:.0f} ops)" for side, m in r["medians"].items()
    )
    return [Check("step overhead", True, f"host time per step: {host}; lean/plain {r['lean_over_plain']:.2f}", r)]


def check_loader(machine: Machine) -> list[Check]:
    r = machine.json_of(
        "criteo_loader.py", "--device", "cuda", "--rows", "8000000", "--batch_size", "16384", "--repeats", "2"
    )
    rate, needed = r["train_samples_per_sec"], machine.best_training_rate
    verdict = f"needs > {needed:,.0f} (training)" if needed else "no training rate measured (run throughput)"
    return [Check("Criteo loader into GPU", rate > needed > 0, f"{rate:,.0f} samples/s; {verdict}", r)]


def plan_in_hbm(rows: int, hbm_gb: float) -> bool:
    """Whether TorchRec's planner places 26 x ``rows`` x 128 tables in the HBM of one GPU of
    ``hbm_gb``, all of them (a plan that caches some from host memory fits, but not in HBM).

    Only the plan app's own verdict answers: any other exit (a crash exits 1) raises, so that a
    broken preview never reads as "does not fit" and shrinks the tables to nothing.
    """
    from apps.core.training.plan import DOES_NOT_FIT  # on use, as torch is: a bad --only needs no torchrec

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.plan",
            "-j",
            "1x1",
            "--gpu",
            "1",
            "--hbm_gb",
            gib_text(hbm_gb),
            *model_args(rows),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    if result.returncode not in (0, DOES_NOT_FIT):
        raise RuntimeError(
            f"the plan preview (python -m apps.dlrm.plan) failed with exit {result.returncode}, "
            f"not a verdict; run it alone to see why: {result.stderr[-2000:]}"
        )
    return result.returncode == 0 and "fused_uvm" not in result.stdout


def gib_text(gib: float) -> str:
    """``gib`` to two decimals, rounded down: the app refuses more HBM than its GPU has."""
    return f"{math.floor(gib * 100) / 100:.2f}"


def model_args(rows: int) -> list[str]:
    return [
        "--num_embeddings",
        str(rows),
        "--embedding_dim",
        str(DIM),
        "--num_sparse_features",
        str(TABLES),
        "--dense_arch_layer_sizes",
        f"512,256,{DIM}",
        "--over_arch_layer_sizes",
        "1024,1024,512,256,1",
        "--batch_size",
        "16384",
    ]


def largest_rows(hbm_gb: float, step: int = 250_000) -> int:
    """The most rows per table (a multiple of ``step``) that the planner fits in HBM alone."""
    lo, hi = 0, int(hbm_gb * 2**30 / (TABLES * DIM * 4)) // step + 1  # hi: the weights alone overflow
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan_in_hbm(mid * step, hbm_gb) else (lo, mid)
    return lo * step


def check_memory(machine: Machine) -> list[Check]:
    import torch

    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    rows = largest_rows(gpu_gb)
    checks = []
    for name, hbm_gb in (("tables in HBM", 0.0), ("tables cached (UVM)", gpu_gb / 4)):
        args = [*model_args(rows), "--steps", "100", "--val_batches", "2", "--test_batches", "2", "--log_every", "50"]
        if hbm_gb:
            args += ["--hbm_gb", gib_text(hbm_gb)]
        s = machine.train(name.split()[1], *args, nproc=1)
        kernels = sorted({line.split("(")[1].split(")")[0] for line in s["sharding_plan"]})
        peak = s["peak_hbm_bytes"] / 2**30
        ok = peak <= (hbm_gb or gpu_gb) and (not hbm_gb or "fused_uvm_caching" in kernels)
        checks.append(
            Check(
                f"memory: {name}",
                ok,
                f"26 x {rows:,} x {DIM} ({TABLES * rows * DIM * 4 / 1e9:.1f} GB), "
                f"kernels {','.join(kernels)}, peak HBM {peak:.1f} of {hbm_gb or gpu_gb:.1f} GiB, "
                f"{s['samples_per_sec']:,.0f} samples/s",
                {
                    "rows": rows,
                    "hbm_gb": hbm_gb or gpu_gb,
                    "kernels": kernels,
                    "peak_hbm_gib": peak,
                    "samples_per_sec": s["samples_per_sec"],
                },
            )
        )
    return checks


CHECKS: dict[str, Callable[[Machine], list[Check]]] = {
    "main_job": check_main_job,
    "equivalence": check_equivalence,
    "checkpoint": check_checkpoint,
    "precisions": check_precisions,
    "throughput": check_throughput,
    "step_overhead": check_step_overhead,
    "loader": check_loader,
    "memory": check_memory,
}


def run_checks(names: list[str], machine: Machine) -> list[Check]:
    """Runs the named checks in order; one that raises is a failed row, and the others still run."""
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            rows = CHECKS[name](machine)
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            traceback.print_exc()
            rows = [
                Check(name, False, f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
            ]
        for row in rows:
            print(f"{'ok  ' if row.ok else 'FAIL'}  {row.name}: {row.summary}", flush=True)
        print(f"      ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
        results += rows
    return results


def render(results: list[Check]) -> str:
    width = max(len(r.name) for r in results)
    return "\n".join(f"{r.name:{width}s}  {'ok' if r.ok else 'FAILED':6s}  {r.summary}" for r in results)


def parse_names(text: str) -> list[str]:
    """The checks --only names, in the order they run; all for an empty text."""
    names = [name for name in text.split(",") if name] or list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"no such check: {','.join(unknown)}; use some of {','.join(CHECKS)}")
    return [name for name in CHECKS if name in names]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "torchrec", "fbgemm-gpu", "fbgemm_gpu_nightly"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        type=parse_names,
        default=list(CHECKS),
        help=f"some of {','.join(CHECKS)}, comma separated (default: all)",
    )
    parser.add_argument("--output", default="", help="the JSON file (default $OUT_DIR/gpu_check.json)")
    opts = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False): run "
            "it on a GPU machine after `make install`",
            file=sys.stderr,
        )
        sys.exit(2)
    output = opts.output or os.path.join(os.environ.get("OUT_DIR", "."), "gpu_check.json")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        machine = Machine(gpus=torch.cuda.device_count(), workdir=workdir)
        device = f"{machine.gpus} x {torch.cuda.get_device_name(0)}"
        print(f"gpu_check on {device}; {versions()}", flush=True)
        results = run_checks(opts.only, machine)
    print("\n" + render(results))
    with open(output, "w") as f:
        json.dump({"device": device, "versions": versions(), "checks": [asdict(r) for r in results]}, f, indent=2)
    print(f"wrote {output}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
