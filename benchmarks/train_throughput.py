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

A preset with steady rows (h100) times the steps itself, in each rank (benchmarks/steps.py: the
app Trainer's step, or the plain loop's): samples/s in windows of ``--window`` steps (100), a
row's figure the median of its windows after the first, so that neither side's warm-up (the
first window) counts. The app's row names its step (``lean`` at one rank with whole tables,
``lean graph`` where a GPU replays it as one CUDA graph, else ``sharded``); ``--levers
sharded_step`` adds the sharded step at one rank, ``eager_step`` the lean one without its graph. Its rows feed
batches made in the loop (as training does: the synthetic teacher runs on the rank's device);
the plain and app rows are measured again with batches from a pool made before the timed loop
(``pooled_rows`` of ``--json``), so that making batches is seen apart.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from benchmarks import cli  # noqa: E402


@dataclass(frozen=True)
class Preset:
    args: list[str]
    min_ratio: float  # app / plain TorchRec
    min_samples_per_sec: float = 0.0  # of the app's best configuration
    steady: bool = False  # rows timed in the ranks, steady windows, and pooled rows too

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
        steady=True,
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
    # The lean step eager where it would be one CUDA graph (a GPU: apps/core/training/step_graph.py).
    "eager_step": ["--step_graph", "false"],
    # Twice the preset's batch per rank (the AUROC at a larger batch is the main job's to show).
    "batch_x2": lambda cfg: ["--batch_size", str(2 * cfg.training.batch_size)],
}
#: Levers that only run on GPUs.
GPU_LEVERS = {"cuda_graphs", "semi_sync", "fused_sparse_dist", "prefetch", "eager_step"}


def app_samples_per_sec(nproc: int, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        cli.torchrun(
            nproc, ["-m", "apps.dlrm.train", *args, "--val_batches", "1", "--test_batches", "1", "--output_dir", out]
        )
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["samples_per_sec"]


def plain_samples_per_sec(nproc: int, args: list[str]) -> float:
    return cli.torchrun_figures(nproc, [os.path.join(HERE, "plain_torchrec_loop.py"), *args])["samples_per_sec"]


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


PLAIN = "plain TorchRec"
#: The suffix of a steady preset's rows whose batches come from a pool made before the timed loop.
POOLED = ", pooled batches"


def steady_samples_per_sec(opts: argparse.Namespace, side: str, args: list[str], pool: bool) -> dict:
    """One run of ``side`` (plain or app) timed in its ranks (:func:`worker`): its steady
    samples/s and which step it took."""
    worker_args = ["--worker", side, "--window", str(opts.window), *(["--pool"] if pool else []), "--", *args]
    return cli.torchrun_figures(opts.nproc, [os.path.abspath(__file__), *worker_args])


def window_rates(step: Callable[[], Any], steps: int, window: int, samples_per_step: int) -> list[float]:
    """samples/s of each ``window`` steps of ``steps`` calls of ``step`` (which returns the loss,
    read at each window's end so that a GPU's queued work is in its window)."""
    rates = []
    start = time.perf_counter()
    for i in range(1, steps + 1):
        loss = step()
        if i % window == 0:
            float(loss)
            now = time.perf_counter()
            rates.append(window * samples_per_step / (now - start))
            start = now
    return rates


def worker(opts: argparse.Namespace) -> None:
    """Under torchrun, one rank of a steady run: times its steps; rank 0 prints one JSON line of
    the windows' samples/s (every rank's), their median after the first, and the step taken."""
    import torch.distributed as dist

    from apps.dlrm.config import parse_train_config
    from benchmarks.steps import app_step, plain_step

    cfg = parse_train_config(opts.app_args)
    step, kind = (
        (plain_step(opts.app_args, opts.pool), "plain")
        if opts.worker == "plain"
        else app_step(opts.app_args, opts.pool)
    )
    samples = cfg.training.batch_size * dist.get_world_size()
    rates = window_rates(step, cfg.training.steps, opts.window, samples)
    if dist.get_rank() == 0:
        print(json.dumps({"step": kind, "windows": rates, "samples_per_sec": statistics.median(rates[1:])}), flush=True)


def configs_of(opts: argparse.Namespace, levers: list[str]) -> dict[str, list[str] | None]:
    """The configurations to run, by name: the app's arguments, None for plain TorchRec."""
    args = PRESETS[opts.preset].args + opts.app_args
    configs = {PLAIN: None, "app": args, **{f"app +{lever}": with_lever(args, lever) for lever in levers}}
    if PRESETS[opts.preset].steady:
        configs |= {PLAIN + POOLED: None, "app" + POOLED: args}
    return configs


def measure(opts: argparse.Namespace, levers: list[str]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """samples/s of each run, per configuration, and the step each app configuration took
    (steady presets only); runs of all configurations alternate."""
    preset = PRESETS[opts.preset]
    args = preset.args + opts.app_args
    configs = configs_of(opts, levers)
    runs: dict[str, list[float]] = {name: [] for name in configs}
    steps: dict[str, str] = {}
    for i in range(opts.repeats):
        for name, app_args in configs.items():
            if preset.steady:
                side = "plain" if app_args is None else "app"
                result = steady_samples_per_sec(opts, side, app_args or args, pool=name.endswith(POOLED))
                rate, steps[name] = result["samples_per_sec"], result["step"]
            elif app_args is None:
                rate = plain_samples_per_sec(opts.nproc, args)
            else:
                rate = app_samples_per_sec(opts.nproc, app_args)
            runs[name].append(rate)
            print(f"run {i + 1}: {name:36s} {rate:14,.0f} samples/s", flush=True)
    return runs, steps


def rows_of(runs: dict[str, list[float]], steps: dict[str, str], plain: str) -> list[dict]:
    """The table's rows of the configurations in ``runs``: median samples/s and its ratio to the
    ``plain`` configuration's; an app row's name says which step it took, where known."""
    baseline = statistics.median(runs[plain])
    rows = []
    for name, rates in runs.items():
        step = steps.get(name, "plain")
        label = name if step == "plain" else f"{name} ({step} step)"
        rows.append(
            {"config": label, "samples_per_sec": statistics.median(rates), "ratio": statistics.median(rates) / baseline}
        )
    return rows


def report(opts: argparse.Namespace, runs: dict[str, list[float]], steps: dict[str, str]) -> dict:
    """Prints the table and the verdict; returns them as a JSON-able record. The verdict is the
    best app row's with batches made in the loop, as training makes them."""
    preset = PRESETS[opts.preset]
    in_loop = {name: rates for name, rates in runs.items() if not name.endswith(POOLED)}
    rows = rows_of(in_loop, steps, PLAIN)
    pooled = {name: rates for name, rates in runs.items() if name.endswith(POOLED)}
    pooled_rows = rows_of(pooled, steps, PLAIN + POOLED) if pooled else []
    best = max(rows[1:], key=lambda row: row["samples_per_sec"])
    meets = best["ratio"] >= preset.min_ratio and best["samples_per_sec"] >= preset.min_samples_per_sec
    how = f"steady: medians of {opts.window}-step windows after the first" if preset.steady else "whole runs"
    print(
        f"\npreset {opts.preset} {' '.join(opts.app_args)}; ranks: {opts.nproc}; median of {opts.repeats} runs; {how}"
    )
    print(f"{'configuration':44s} {'samples/s':>14s} {'ratio':>7s}")
    for row in rows + pooled_rows:
        print(f"{row['config']:44s} {row['samples_per_sec']:14,.0f} {row['ratio']:7.3f}")
    print(f"best: {best['config']} at {best['ratio']:.3f}x; target {preset.target()}: {'met' if meets else 'NOT met'}")
    return {
        "preset": opts.preset,
        "nproc": opts.nproc,
        "repeats": opts.repeats,
        "steady_window": opts.window if preset.steady else None,
        "rows": rows,
        "pooled_rows": pooled_rows,
        "best": best["config"],
        "target": preset.target(),
        "target_met": meets,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser(__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    cli.add_nproc(parser)
    cli.add_repeats(parser, 3, "runs of each configuration")
    parser.add_argument("--levers", default="", help=f"all, or some of: {','.join(LEVERS)}")
    parser.add_argument("--window", type=cli.positive, default=100, help="steps of a steady window (steady presets)")
    cli.add_json(parser, "the table")
    parser.add_argument("--worker", choices=("plain", "app"), help=argparse.SUPPRESS)
    parser.add_argument("--pool", action="store_true", help=argparse.SUPPRESS)
    cli.add_app_args(parser)
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return {}
    import torch  # after argument errors, which need no torch

    if PRESETS[opts.preset].steady:
        check_windows(opts)
    record = report(opts, *measure(opts, parse_levers(opts.levers, torch.cuda.is_available())))
    cli.write_report(opts.json, record)
    return record


def check_windows(opts: argparse.Namespace) -> None:
    """Steady rows need a window after the first: exits in one line where --steps has fewer."""
    from apps.dlrm.config import parse_train_config

    steps = parse_train_config(PRESETS[opts.preset].args + opts.app_args).training.steps
    if steps < 2 * opts.window:
        sys.exit(
            f"--steps {steps}: the steady rows need two windows of --window {opts.window} steps at least "
            f"(the first is left out); raise --steps or lower --window"
        )


if __name__ == "__main__":
    from apps.core.common.teardown import exit_without_teardown

    exit_without_teardown(main)
