"""Training throughput of the app against a minimal plain-TorchRec loop, in the same run.

    python benchmarks/train_throughput.py                      # CPU defaults, 2 ranks
    python benchmarks/train_throughput.py --preset h100 --nproc 1 --levers all
    python benchmarks/train_throughput.py -- --sharding_type row_wise --batch_size 1024

Both sides train the same model on the same synthetic batches (made on the rank's device) with
the same world size; runs alternate (baseline, app, app with each lever, baseline, ...) so that
all see the same machine, and medians are compared. Prints a table of configurations, their
samples/s and their ratio to plain TorchRec, and the preset's target.

A lever is one of the app's speed options (--levers NAME,... or all); each row is the preset
plus that lever, so its effect is measured alone against the same baseline.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


@dataclass(frozen=True)
class Preset:
    args: list[str]
    min_ratio: float  # app / plain TorchRec
    min_samples_per_sec: float = 0.0  # of the app's best configuration

    def target(self) -> str:
        text = f"ratio >= {self.min_ratio}"
        return text + (f" and >= {self.min_samples_per_sec:,.0f} samples/s" if self.min_samples_per_sec else "")


PRESETS = {
    # A quick CPU shape: the app's defaults, fewer steps.
    "cpu": Preset(["--steps", "600"], min_ratio=1.0),
    # Reference document 002's DLRM: 26 tables x 1M rows x 128, batch 16384 per GPU, fused
    # RowWiseAdagrad (the app's default embedding optimizer).
    "h100": Preset(
        [
            "--num_embeddings",
            "1000000",
            "--embedding_dim",
            "128",
            "--batch_size",
            "16384",
            "--dense_arch_layer_sizes",
            "512,256,128",
            "--over_arch_layer_sizes",
            "1024,1024,512,256,1",
            "--steps",
            "300",
            "--log_every",
            "100",
            "--sharding_type",
            "table_wise",
        ],
        min_ratio=1.5,
        min_samples_per_sec=4e6,
    ),
}

#: The app's speed options, each measured alone on top of the preset.
LEVERS = {
    "bf16": ["--dense_precision", "bf16"],
    "no_tf32": ["--allow_tf32", "false"],
    "compile": ["--compile_dense", "default"],
    "cuda_graphs": ["--compile_dense", "reduce-overhead"],
    "sparse_dist_lite": ["--pipeline", "sparse_dist_lite"],
    "semi_sync": ["--pipeline", "semi_sync"],
    "fused_sparse_dist": ["--pipeline", "fused_sparse_dist"],
    "prefetch": ["--pipeline", "prefetch"],
    "bf16_compile": ["--dense_precision", "bf16", "--compile_dense", "default"],
    # TorchRec's sharded step where the app would take the lean one (one rank: apps/core/training/lean.py).
    "sharded_step": ["--lean_step", "false"],
    # Twice the preset's batch per rank (the AUROC at a larger batch is the main job's to show).
    "batch_x2": lambda cfg: ["--batch_size", str(2 * cfg.training.batch_size)],
}
#: Levers that only run on GPUs.
GPU_LEVERS = {"cuda_graphs", "semi_sync", "fused_sparse_dist", "prefetch"}


def torchrun(nproc: int, target: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *target]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return result


def app_samples_per_sec(nproc: int, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        torchrun(
            nproc, ["-m", "apps.dlrm.train", *args, "--val_batches", "1", "--test_batches", "1", "--output_dir", out]
        )
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["samples_per_sec"]


def plain_samples_per_sec(nproc: int, args: list[str]) -> float:
    result = torchrun(nproc, [os.path.join(HERE, "plain_torchrec_loop.py"), *args])
    return json.loads(result.stdout.strip().splitlines()[-1])["samples_per_sec"]


def with_lever(args: list[str], lever: str) -> list[str]:
    """The preset's arguments with the lever's options set (a later option wins in argparse)."""
    extra = LEVERS[lever]
    if callable(extra):
        from apps.dlrm.config import parse_train_config

        extra = extra(parse_train_config(args))
    return args + extra


def parse_levers(text: str, gpu: bool) -> list[str]:
    if text == "all":
        return [lever for lever in LEVERS if gpu or lever not in GPU_LEVERS]
    levers = [lever for lever in text.split(",") if lever]
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        sys.exit(f"--levers {','.join(unknown)}: unknown; use all or some of {','.join(LEVERS)}")
    return levers


def measure(opts: argparse.Namespace, levers: list[str]) -> dict[str, list[float]]:
    """samples/s of each run, per configuration; runs of all configurations alternate."""
    args = PRESETS[opts.preset].args + opts.app_args
    configs = {"plain TorchRec": None, "app": args, **{f"app +{lever}": with_lever(args, lever) for lever in levers}}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(opts.repeats):
        for name, app_args in configs.items():
            rate = (
                plain_samples_per_sec(opts.nproc, args)
                if app_args is None
                else app_samples_per_sec(opts.nproc, app_args)
            )
            runs[name].append(rate)
            print(f"run {i + 1}: {name:28s} {rate:14,.0f} samples/s", flush=True)
    return runs


def report(opts: argparse.Namespace, runs: dict[str, list[float]]) -> dict:
    """Prints the table and the verdict; returns them as a JSON-able record."""
    preset = PRESETS[opts.preset]
    plain = statistics.median(runs["plain TorchRec"])
    rows = [
        {"config": name, "samples_per_sec": statistics.median(rates), "ratio": statistics.median(rates) / plain}
        for name, rates in runs.items()
    ]
    best = max(rows[1:], key=lambda row: row["samples_per_sec"])
    meets = best["ratio"] >= preset.min_ratio and best["samples_per_sec"] >= preset.min_samples_per_sec
    print(f"\npreset {opts.preset} {' '.join(opts.app_args)}; ranks: {opts.nproc}; median of {opts.repeats} runs")
    print(f"{'configuration':30s} {'samples/s':>14s} {'ratio':>7s}")
    for row in rows:
        print(f"{row['config']:30s} {row['samples_per_sec']:14,.0f} {row['ratio']:7.3f}")
    print(f"best: {best['config']} at {best['ratio']:.3f}x; target {preset.target()}: {'met' if meets else 'NOT met'}")
    return {
        "preset": opts.preset,
        "nproc": opts.nproc,
        "repeats": opts.repeats,
        "rows": rows,
        "best": best["config"],
        "target": preset.target(),
        "target_met": meets,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    parser.add_argument("--levers", default="", help=f"all, or some of: {','.join(LEVERS)}")
    parser.add_argument("--json", default="", help="also write the table to this file")
    parser.add_argument("app_args", nargs="*", help="more app options, after --")
    opts = parser.parse_args(argv)
    import torch  # after argument errors, which need no torch

    record = report(opts, measure(opts, parse_levers(opts.levers, torch.cuda.is_available())))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
