"""How long a checkpoint stops training: background (--checkpoint_async) against synchronous saves.

    python benchmarks/checkpoint_stall.py                   # 2 ranks, local disk (~1 GB) and S3 (~0.1 GB)
    python benchmarks/checkpoint_stall.py --rows 250000 --repeats 1 --targets local --json stall.json

For each target (a local folder; an S3 bucket on an S3-compatible server on loopback, moto), the
same training job runs with each kind of save, alternately, ``--repeats`` times, saving every
``--every`` steps to a fresh folder (defaults per target: ``JOBS``); each reports the seconds every save blocked its training
loop (summary.json's ``checkpoint_stall_seconds``: for a background save, the copy to host memory
and any wait for the save before it). Prints the median stall of each kind and their ratio
(target <= 0.2), the first save's apart (a background save allocates its host buffers then), and
the training samples/s of each run. On S3 a synchronous save stalls for the whole upload; a
background one only for the copy to host memory, as long as the upload ends before the next save
is due (the run then warns, and ``checkpoint_wait_seconds`` says how long each save waited).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import uuid
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cli  # noqa: E402
from benchmarks.moto_s3 import add_targets_argument, s3_bucket  # noqa: E402

MODES = {"async": "true", "sync": "false"}
TARGET = 0.2


@dataclass(frozen=True)
class Job:
    rows: int
    steps: int
    every: int


#: The job of each target: 8 tables x rows x 32 with Adagrad state (~1.06 GB at 1M rows), a save
#: every ``every`` steps. Real runs save far less often than a save takes, so a background save
#: ends before the next is due; moto on loopback takes ~0.04 GB/s here, so S3 saves fewer rows.
JOBS = {"local": Job(rows=1_000_000, steps=600, every=100), "s3": Job(rows=100_000, steps=1200, every=200)}


def job_args(job: Job) -> list[str]:
    """The training job's options for ``job``."""
    return [
        "--num_sparse_features",
        "8",
        "--num_embeddings",
        str(job.rows),
        "--embedding_dim",
        "32",
        "--dense_arch_layer_sizes",
        "64,32",
        "--sharding_type",
        "table_wise",
        "--steps",
        str(job.steps),
        "--checkpoint_every",
        str(job.every),
        "--keep_last",
        "1",
        "--log_every",
        str(job.every),
        "--val_batches",
        "1",
        "--test_batches",
        "1",
    ]


class Target:
    """Where the runs checkpoint: fresh folders under a local folder or an S3 prefix, and the
    environment that reaches it."""

    def __init__(self, name: str, root: str, env: dict[str, str]) -> None:
        self.name, self.root, self.env = name, root, env

    def fresh_folder(self) -> str:
        return f"{self.root}/{uuid.uuid4().hex[:8]}/ckpt"


def run_job(args: list[str], mode: str, nproc: int, target: Target, workdir: str) -> dict:
    """One training run with ``mode`` saves into a fresh folder of ``target``; its summary."""
    out = tempfile.mkdtemp(dir=workdir)
    train = [
        "-m",
        "apps.dlrm.train",
        *args,
        "--checkpoint_async",
        MODES[mode],
        "--checkpoint_dir",
        target.fresh_folder(),
        "--output_dir",
        out,
    ]
    cli.torchrun(nproc, train, target.env, f"{target.name}, {mode}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def measure(job: Job, opts: argparse.Namespace, target: Target, workdir: str) -> dict:
    """Both kinds of save on ``target``, alternately: prints each run, then the medians; the figures."""
    args = job_args(job)
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    waits: dict[str, list[float]] = {mode: [] for mode in MODES}
    first: dict[str, list[float]] = {mode: [] for mode in MODES}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(opts.repeats):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            summary = run_job(args, mode, opts.nproc, target, workdir)
            first[mode].append(summary["checkpoint_stall_seconds"][0])
            stalls[mode] += summary["checkpoint_stall_seconds"][1:]
            waits[mode] += summary["checkpoint_wait_seconds"][1:]
            rates[mode].append(summary["samples_per_sec"])
            print(
                f"{target.name} run {i + 1} {mode:5s}: stalls "
                f"{', '.join(f'{s:.3f}' for s in summary['checkpoint_stall_seconds'])} s; "
                f"{summary['samples_per_sec']:,.0f} samples/s",
                flush=True,
            )
    median = {mode: statistics.median(values) for mode, values in stalls.items()}
    ratio = median["async"] / median["sync"]
    print(
        f"{target.name}: 8 tables x {job.rows:,} x 32, {opts.nproc} ranks, a save every {job.every} of "
        f"{job.steps} steps, {opts.repeats} runs of each"
    )
    for mode in MODES:
        print(
            f"  {mode:5s} save: training stopped {median[mode]:.3f} s per checkpoint (median of "
            f"{len(stalls[mode])}, of which {statistics.median(waits[mode]):.3f} s waiting for the save "
            f"before; first saves {statistics.median(first[mode]):.3f} s), "
            f"{statistics.median(rates[mode]):,.0f} samples/s"
        )
    print(
        f"  stall ratio async/sync {ratio:.3f} (target <= {TARGET}): {'met' if ratio <= TARGET else 'NOT met'}",
        flush=True,
    )
    return {
        **vars(job),
        "stalls": stalls,
        "waits": waits,
        "first_stalls": first,
        "samples_per_sec": rates,
        "median_stall_seconds": median,
        "ratio": ratio,
        "target_met": ratio <= TARGET,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser(__doc__)
    parser.add_argument("--rows", type=int, help="rows of each of the 8 tables (default: per target, JOBS)")
    parser.add_argument("--steps", type=int, help="training steps of each run (default: per target)")
    parser.add_argument(
        "--every",
        type=int,
        help="steps between checkpoints (default: per target): long enough for a background "
        "write to end, as in real runs (a save that finds the last one writing waits)",
    )
    cli.add_nproc(parser)
    cli.add_repeats(parser, 3, "runs of each kind of save, alternating")
    add_targets_argument(parser)
    cli.add_json(parser)
    opts = parser.parse_args(argv)
    record = {"nproc": opts.nproc, "repeats": opts.repeats}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as workdir:
        for name in opts.targets:
            with contextlib.ExitStack() as stack:
                target = (
                    Target(name, "s3://bench/stall", stack.enter_context(s3_bucket("bench")))
                    if name == "s3"
                    else Target(name, os.path.join(workdir, "ckpt"), {})
                )
                job = Job(**{field: getattr(opts, field) or default for field, default in vars(JOBS[name]).items()})
                record[name] = measure(job, opts, target, workdir)
    cli.write_report(opts.json, record)
    return record


if __name__ == "__main__":
    main()
