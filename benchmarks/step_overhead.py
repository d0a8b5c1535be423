"""Host time per training step, and ops dispatched per step, at shapes where compute vanishes:
the app's lean step, its sharded step and a plain TorchRec loop, in the same run.

    python benchmarks/step_overhead.py                       # 1 rank, 26 tables of 64 x 8, batch 8
    python benchmarks/step_overhead.py --steps 300 --repeats 5 --json out.json
    python benchmarks/step_overhead.py -- --embedding_dim 16 # more app options, after --

At these shapes a step's arithmetic is a few microseconds: what is left is what the host does per
step (Python, TorchRec's and torch's dispatch, collectives of one rank), which bounds a GPU's step
as it bounds a CPU's (issue 37). Three sides, each one rank in its own torchrun (a process of its
own, so none inherits another's caches), alternating side by side ``--repeats`` times so that all
see the same machine; each side's figure is the median of its runs:

- lean: the app's Trainer step with --lean_step auto, which must take the lean step
  (apps/core/training/lean.py: the tables' FBGEMM kernels called directly, no all-to-alls, no DDP);
- sharded: the app's Trainer step with --lean_step false (TorchRec's sharded module in DMP with
  DDP, TrainPipelineSparseDist), what one rank ran before the lean step (``benchmarks/
  train_throughput.py --nproc 1 --levers sharded_step`` compares the two at any shape);
- plain: ``benchmarks/plain_torchrec_loop.py``'s pipeline, the same model as users write it.

Each side's batches are a pool made before any step and cycled, so that making batches (the
synthetic data's teacher: milliseconds at batch 8 on a CPU) is no side's cost. After
``--warmup`` steps, ``--steps`` steps are timed (wall clock, ending with the last loss read, so
on a GPU the device's work is in it: at these shapes the GPU waits for the host); then
``--count_steps`` more run under a ``TorchDispatchMode`` that counts every operator dispatched
(aten, FBGEMM, c10d's collectives), forward and backward. The last line reads
``lean/plain host time per step: R``; the CPU target is R <= 0.5.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import cli  # noqa: E402
from benchmarks.steps import app_step, plain_step  # noqa: E402

SIDES = ("lean", "sharded", "plain")
#: The issue's tiny shapes: 26 tables (the app's default count) of 64 rows x 8, batch 8.
TINY = ["--num_embeddings", "64", "--embedding_dim", "8", "--dense_arch_layer_sizes", "64,8", "--batch_size", "8"]
TARGET = 0.5  # lean / plain host time per step, on a CPU


def counted_ops(step: Callable[[], Any], steps: int) -> int:
    """Operators dispatched (below autograd: what kernels run, forward and backward) by ``steps``
    calls of ``step``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        for _ in range(steps):
            step()
    return Counter.ops


def measure_side(step: Callable[[], Any], opts: argparse.Namespace) -> dict[str, float]:
    """Per step of ``step`` (which returns the step's loss): host time (the process's CPU time,
    every thread's: what other processes' load leaves unchanged, where wall time counts their
    turns on the cores too), wall time, and operators dispatched."""
    for _ in range(opts.warmup):
        step()
    wall, host = time.perf_counter(), time.process_time()
    for _ in range(opts.steps):
        loss = step()
    float(loss)  # the last step's work done (a GPU's queue drained)
    host, wall = time.process_time() - host, time.perf_counter() - wall
    return {
        "host_ms_per_step": host / opts.steps * 1e3,
        "wall_ms_per_step": wall / opts.steps * 1e3,
        "ops_per_step": counted_ops(step, opts.count_steps) / opts.count_steps,
    }


def side_step(side: str, app_args: list[str]) -> Callable[[], Any]:
    """``side``'s step on a pool of its batches: the app Trainer's (lean or sharded) or plain
    TorchRec's."""
    if side == "plain":
        return plain_step(app_args, pool=True)
    step, kind = app_step([*app_args, "--lean_step", "auto" if side == "lean" else "false"], pool=True)
    if kind != side:
        sys.exit(f"step_overhead: the {side} side took the {kind} step")
    return step


def worker(opts: argparse.Namespace) -> None:
    """Under torchrun, one rank: measures ``opts.worker``'s side and prints it as one JSON line."""
    step = side_step(opts.worker, opts.app_args)
    print(json.dumps({"side": opts.worker, **measure_side(step, opts)}), flush=True)


def run_side(side: str, opts: argparse.Namespace) -> dict[str, float]:
    counts = ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--count_steps", str(opts.count_steps)]
    return cli.torchrun_figures(1, [os.path.abspath(__file__), "--worker", side, *counts, "--", *TINY, *opts.app_args])


FIGURES = ("host_ms_per_step", "wall_ms_per_step", "ops_per_step")


def report(runs: dict[str, list[dict[str, float]]], opts: argparse.Namespace) -> dict[str, Any]:
    """Prints each side's medians and their host time's ratio to plain's (the last line:
    lean's); returns them as a JSON-able record."""
    medians = {
        side: {name: statistics.median(run[name] for run in side_runs) for name in FIGURES}
        for side, side_runs in runs.items()
    }
    ratios = {
        side: figures["host_ms_per_step"] / medians["plain"]["host_ms_per_step"] for side, figures in medians.items()
    }
    print(f"\n1 rank, {' '.join(TINY + opts.app_args)}; {opts.steps} steps timed; medians of {opts.repeats} runs")
    print(f"{'step':8s} {'host ms/step':>12s} {'wall ms/step':>12s} {'ops/step':>9s} {'host / plain':>12s}")
    for side, figures in medians.items():
        print(
            f"{side:8s} {figures['host_ms_per_step']:12.3f} {figures['wall_ms_per_step']:12.3f} "
            f"{figures['ops_per_step']:9.0f} {ratios[side]:12.3f}"
        )
    print(f"lean/plain host time per step: {ratios['lean']:.3f}")
    return {
        "steps": opts.steps,
        "repeats": opts.repeats,
        "app_args": TINY + opts.app_args,
        "medians": medians,
        "runs": runs,
        "lean_over_plain": ratios["lean"],
        "sharded_over_plain": ratios["sharded"],
        "target": TARGET,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__)
    parser.add_argument("--steps", type=cli.positive, default=500, help="timed steps of each run")
    parser.add_argument("--warmup", type=cli.positive, default=50, help="steps of each run before the timed ones")
    parser.add_argument("--count_steps", type=cli.positive, default=5, help="steps whose operators are counted")
    cli.add_repeats(parser, 3, "runs of each side, alternating")
    cli.add_json(parser)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    cli.add_app_args(parser)
    opts = parser.parse_args(argv)
    if opts.worker:
        worker(opts)
        return {}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for i in range(opts.repeats):
        for side in SIDES:
            runs[side].append(run_side(side, opts))
            figures = runs[side][-1]
            print(
                f"run {i + 1}: {side:8s} host {figures['host_ms_per_step']:7.3f} ms/step, wall "
                f"{figures['wall_ms_per_step']:7.3f}, {figures['ops_per_step']:4.0f} ops/step",
                flush=True,
            )
    record = report(runs, opts)
    cli.write_report(opts.json, record)
    return record


if __name__ == "__main__":
    from apps.core.common.teardown import exit_without_teardown

    exit_without_teardown(main)
