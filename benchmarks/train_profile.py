"""Where a training step's time goes: the DLRM app's steady steps under torch.profiler.

    python benchmarks/train_profile.py --preset h100 --json profile.json --trace trace.json
    python benchmarks/train_profile.py --warmup 10 --steps 20 -- --batch_size 4096

One process (a world of one, on the GPU when there is one) builds the app's Trainer, as
``python -m apps.dlrm.train`` does, trains ``--warmup`` steps (compilation, caches and the
allocator settle), then profiles ``--steps`` more with CPU and CUDA activities. It reports the wall
time of those steps against the time the GPU was busy (the union of its kernels', copies' and
memsets' intervals on every stream: 1.0 means the GPU never waited for the host), the kernels that
took the most GPU time, and whether TF32 is in effect: torch's settings, and the share of GPU time
spent in kernels that name tf32 (cuBLAS's and CUTLASS's TF32 GEMMs do). Without a GPU it profiles
the CPU's operators instead (a quick check of the script, no figure of a GPU).
"""

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from apps.core.common.distributed import init_distributed, leave_process_group  # noqa: E402
from apps.core.common.teardown import exit_without_teardown  # noqa: E402
from apps.dlrm.config import parse_train_config  # noqa: E402
from apps.dlrm.training.app import Trainer  # noqa: E402
from benchmarks import cli  # noqa: E402
from benchmarks.train_throughput import PRESETS  # noqa: E402


def tf32_settings() -> dict[str, Any]:
    """torch's TF32 switches as this process has them: the legacy flags, and on torch >= 2.9 the
    fp32_precision settings that replace them ("tf32" or "ieee"; absent before 2.9)."""
    settings: dict[str, Any] = {
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    for name, where in (("matmul.fp32_precision", torch.backends.cuda.matmul), ("fp32_precision", torch.backends)):
        if hasattr(where, "fp32_precision"):
            settings[name] = where.fp32_precision
    return settings


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (start, end), in the same unit."""
    busy, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy


def device_figures(events: list[Any], wall_s: float, top: int) -> dict[str, Any]:
    """GPU busy time and the top kernels, from the profiler's device events. The annotations that
    record_function ranges (TorchRec's) leave on the GPU's timeline span idle gaps: left out, as
    torch's own table leaves them out of device time."""
    work = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in work:
        per_kernel[e.name].append(e.time_range.elapsed_us())
    total_us = sum(sum(times) for times in per_kernel.values()) or 1.0
    busy_s = busy_seconds([(e.time_range.start, e.time_range.end) for e in work]) / 1e6
    tf32_us = sum(sum(times) for name, times in per_kernel.items() if "tf32" in name.lower())
    ranked = sorted(per_kernel.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "gpu_busy_s": busy_s,
        "gpu_busy_fraction": busy_s / wall_s,
        "tf32_kernel_share": tf32_us / total_us,
        "top": [
            {"name": name, "calls": len(times), "total_ms": sum(times) / 1e3, "share": sum(times) / total_us}
            for name, times in ranked
        ],
    }


def cpu_figures(prof: profile, top: int) -> dict[str, Any]:
    """Without a GPU: the operators with the most self CPU time."""
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    total_us = sum(a.self_cpu_time_total for a in prof.key_averages()) or 1.0
    return {
        "top": [
            {
                "name": a.key,
                "calls": a.count,
                "total_ms": a.self_cpu_time_total / 1e3,
                "share": a.self_cpu_time_total / total_us,
            }
            for a in averages
        ]
    }


def profile_steps(opts: argparse.Namespace, app_args: list[str]) -> dict[str, Any]:
    """Builds the app's Trainer, trains the warmup steps, then profiles the measured ones."""
    cfg = parse_train_config([*app_args, "--steps", str(opts.warmup + opts.steps), "--output_dir", ""])
    env = init_distributed()
    trainer = Trainer(cfg, env)
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        batches = trainer.data.train_batches()
        for _ in range(opts.warmup):
            trainer.train_step(batches)
        sync()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(opts.steps):
                loss = trainer.train_step(batches)
            loss.item()  # the last step's work is done
            sync()
            wall_s = time.perf_counter() - start
        figures = device_figures(list(prof.events()), wall_s, opts.top) if cuda else cpu_figures(prof, opts.top)
        if opts.trace:
            prof.export_chrome_trace(opts.trace)
            if not os.path.exists(opts.trace):  # kineto only logs a file it could not write
                raise OSError(f"--trace {opts.trace}: the profiler could not write it (does its folder exist?)")
    finally:
        trainer.close()
        leave_process_group()
    return {
        "device": torch.cuda.get_device_name(env.device) if cuda else "cpu",
        "torch": torch.__version__,
        "warmup": opts.warmup,
        "steps": opts.steps,
        "batch_size": cfg.training.batch_size,
        "wall_s": wall_s,
        "samples_per_sec": opts.steps * cfg.training.batch_size / wall_s,
        "tf32": tf32_settings(),
        **figures,
    }


def report(record: dict[str, Any]) -> None:
    print(
        f"{record['steps']} steps of batch {record['batch_size']} after {record['warmup']} on {record['device']}: "
        f"{record['wall_s'] * 1e3:.1f} ms wall, {record['samples_per_sec']:,.0f} samples/s"
    )
    if "gpu_busy_s" in record:
        print(
            f"GPU busy {record['gpu_busy_s'] * 1e3:.1f} ms ({record['gpu_busy_fraction']:.0%} of wall); "
            f"kernels naming tf32: {record['tf32_kernel_share']:.0%} of kernel time"
        )
    print("TF32: " + ", ".join(f"{name}={value}" for name, value in record["tf32"].items()))
    print(f"{'share':>6s} {'ms':>9s} {'calls':>6s}  {'GPU kernel' if 'gpu_busy_s' in record else 'CPU operator'}")
    for row in record["top"]:
        print(f"{row['share']:6.1%} {row['total_ms']:9.2f} {row['calls']:6d}  {row['name'][:110]}")


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="train_throughput.py's model and batch")
    parser.add_argument("--warmup", type=int, default=30, help="steps trained before the profile")
    parser.add_argument("--steps", type=int, default=20, help="steps profiled")
    parser.add_argument("--top", type=int, default=15, help="kernels (operators on CPU) listed")
    cli.add_json(parser)
    parser.add_argument("--trace", default="", help="also write the profile as a Chrome trace (Perfetto) here")
    cli.add_app_args(parser)
    opts = parser.parse_args(argv)
    if opts.warmup < 1 or opts.steps < 1:
        parser.error(f"--warmup {opts.warmup} and --steps {opts.steps} must both be at least 1")
    app_args = (PRESETS[opts.preset].args if opts.preset else []) + opts.app_args
    record = profile_steps(opts, app_args)
    report(record)
    cli.write_report(opts.json, record)


if __name__ == "__main__":
    exit_without_teardown(main)
