"""How long a checkpoint stops training: background (--checkpoint_async) against synchronous saves.

    python benchmarks/checkpoint_stall.py                   # ~1 GB of tables, 2 ranks, local disk
    python benchmarks/checkpoint_stall.py --rows 250000 --repeats 1 --json stall.json

The same training job runs with each kind of save, alternately, ``--repeats`` times, saving every
``--every`` steps to a fresh folder; each reports the seconds every save blocked its training
loop (summary.json's ``checkpoint_stall_seconds``: for a background save, the copy to host memory
and any wait for the save before it). Prints the median stall of each kind and their ratio
(target <= 0.2), the first save's apart (a background save allocates its host buffers then), and
the training samples/s of each run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"async": "true", "sync": "false"}
TARGET = 0.2


def job_args(rows: int, steps: int, every: int) -> list[str]:
    """A job of 8 tables x ``rows`` x 32 (with Adagrad state, ~1 GB at 1M rows) saving every ``every``."""
    return ["--num_sparse_features", "8", "--num_embeddings", str(rows), "--embedding_dim", "32",
            "--dense_arch_layer_sizes", "64,32", "--sharding_type", "table_wise", "--steps", str(steps),
            "--checkpoint_every", str(every), "--keep_last", "1", "--log_every", str(every),
            "--val_batches", "1", "--test_batches", "1"]


def run_job(args: list[str], mode: str, nproc: int, workdir: str) -> dict:
    """One training run with ``mode`` saves into a fresh folder under ``workdir``; its summary."""
    out = tempfile.mkdtemp(dir=workdir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "apps.dlrm.train", *args, "--checkpoint_async", MODES[mode],
           "--checkpoint_dir", os.path.join(out, "ckpt"), "--output_dir", out]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({mode}): {' '.join(cmd)}\n{result.stderr[-4000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each of the 8 tables")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100,
                        help="steps between checkpoints: long enough for a background write to end, as "
                             "in real runs (a save that finds the last one still writing waits for it)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="", help="also write the figures to this file")
    opts = parser.parse_args(argv)
    args = job_args(opts.rows, opts.steps, opts.every)
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    first: dict[str, list[float]] = {mode: [] for mode in MODES}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as workdir:
        for i in range(opts.repeats):
            for mode in MODES:
                summary = run_job(args, mode, opts.nproc, workdir)
                first[mode].append(summary["checkpoint_stall_seconds"][0])
                stalls[mode] += summary["checkpoint_stall_seconds"][1:]
                rates[mode].append(summary["samples_per_sec"])
                print(f"run {i + 1} {mode:5s}: stalls {', '.join(f'{s:.3f}' for s in summary['checkpoint_stall_seconds'])} s; "
                      f"{summary['samples_per_sec']:,.0f} samples/s", flush=True)
    median = {mode: statistics.median(values) for mode, values in stalls.items()}
    ratio = median["async"] / median["sync"]
    print(f"\n8 tables x {opts.rows:,} x 32, {opts.nproc} ranks, a save every {opts.every} of {opts.steps} steps, "
          f"{opts.repeats} runs of each")
    for mode in MODES:
        print(f"{mode:5s} save: training stopped {median[mode]:.3f} s per checkpoint (median of {len(stalls[mode])}; "
              f"first saves {statistics.median(first[mode]):.3f} s), {statistics.median(rates[mode]):,.0f} samples/s")
    print(f"stall ratio async/sync {ratio:.3f} (target <= {TARGET}): {'met' if ratio <= TARGET else 'NOT met'}")
    record = {"rows": opts.rows, "nproc": opts.nproc, "repeats": opts.repeats, "stalls": stalls, "first_stalls": first,
              "median_stall_seconds": median, "ratio": ratio, "target_met": ratio <= TARGET}
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
