"""Training throughput of the app against a minimal plain-TorchRec loop, in the same run.

    python benchmarks/train_throughput.py                      # CPU defaults, 2 ranks
    python benchmarks/train_throughput.py --preset h100 --nproc 1
    python benchmarks/train_throughput.py -- --sharding_type row_wise --batch_size 1024

Both sides train the same model on the same synthetic batches with the same world size; runs
alternate (app, baseline, app, ...) so that both see the same machine, and the medians are
compared. Prints samples/s of each and their ratio (target >= 1.0).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

PRESETS = {
    # A quick CPU shape: the app's defaults, fewer steps.
    "cpu": ["--steps", "600"],
    # Reference document 002's DLRM: 26 tables x 1M rows x 128, batch 16384 per GPU.
    "h100": [
        "--num_embeddings", "1000000", "--embedding_dim", "128", "--batch_size", "16384",
        "--dense_arch_layer_sizes", "512,256,128", "--over_arch_layer_sizes", "1024,1024,512,256,1",
        "--steps", "300", "--sharding_type", "table_wise",
    ],
}


def torchrun(nproc: int, target: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *target]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return result


def app_samples_per_sec(nproc: int, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        torchrun(nproc, ["-m", "apps.dlrm.train", *args, "--val_batches", "1", "--test_batches", "1",
                         "--output_dir", out])
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["samples_per_sec"]


def plain_samples_per_sec(nproc: int, args: list[str]) -> float:
    result = torchrun(nproc, [os.path.join(HERE, "plain_torchrec_loop.py"), *args])
    return json.loads(result.stdout.strip().splitlines()[-1])["samples_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("app_args", nargs="*", help="more app options, after --")
    opts = parser.parse_args()
    args = PRESETS[opts.preset] + opts.app_args
    app, plain = [], []
    for i in range(opts.repeats):
        app.append(app_samples_per_sec(opts.nproc, args))
        plain.append(plain_samples_per_sec(opts.nproc, args))
        print(f"run {i + 1}: app {app[-1]:,.0f}  plain TorchRec {plain[-1]:,.0f} samples/s", flush=True)
    app_median, plain_median = statistics.median(app), statistics.median(plain)
    print(f"\nmodel/data: preset {opts.preset} {' '.join(opts.app_args)}; ranks: {opts.nproc}")
    print(f"app             {app_median:12,.0f} samples/s (median of {opts.repeats})")
    print(f"plain TorchRec  {plain_median:12,.0f} samples/s (median of {opts.repeats})")
    print(f"ratio app/plain {app_median / plain_median:12.3f}   (target >= 1.0)")


if __name__ == "__main__":
    main()
