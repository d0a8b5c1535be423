"""Samples/s of the Criteo training loader (apps.dlrm.data.criteo) in one process, from page cache.

    python benchmarks/criteo_loader.py                      # 4M rows, batch 8192, shuffled
    python benchmarks/criteo_loader.py --rows 20000000 --batch_size 16384 --no-shuffle

Writes a preprocessed folder of random rows in the documented layout (4 days), reads it once so
it is in the page cache, then times ``train_batches`` (and ``eval_batches``) of one rank the way
the training loop consumes them. Prints samples/s by the wall clock (with the background thread
assembling batches) and per CPU-second of the process. Target: >= 5M samples/s on one core, so
that a few loader cores feed 4M samples/s to an H100.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.dlrm.config import TrainConfig  # noqa: E402
from apps.dlrm.criteo.layout import ARRAYS, FORMAT, FORMAT_VERSION, array_file, day_report_file, write_json  # noqa: E402
from apps.dlrm.criteo.tables import TABLE_SIZE_PRESETS  # noqa: E402
from apps.dlrm.data.criteo import CriteoClickLogs  # noqa: E402

DAYS = 4


def write_folder(folder: str, rows: int) -> None:
    rng = np.random.default_rng(0)
    sizes = np.array(TABLE_SIZE_PRESETS["mlperf"])
    names = [f"day_{d}" for d in range(DAYS)]
    for day in names:
        n = rows // DAYS
        arrays = {
            "dense": rng.random((n, 13), dtype=np.float32) * 8,
            "sparse": (rng.integers(0, 2**31, (n, 26)) % sizes).astype(np.int32),
            "labels": rng.integers(0, 2, (n, 1)).astype(np.int32),
        }
        for name, array in arrays.items():
            assert array.dtype == ARRAYS[name][0]
            np.save(os.path.join(folder, array_file(day, name)), array)
        write_json(os.path.join(folder, day_report_file(day)), {})
    write_json(os.path.join(folder, "manifest.json"), {
        "format": FORMAT, "version": FORMAT_VERSION, "categorical_ids": "hash",
        "num_embeddings_per_feature": sizes.tolist(), "days": names,
    })


def warm(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


def measure(batches, count: int) -> tuple[float, float]:
    """(samples/s wall, samples per CPU-second) of consuming ``count`` batches."""
    next(batches)  # start the thread, fill the queue
    samples = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        samples += next(batches).labels.shape[0]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    batches.close()
    return samples / wall, samples / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--shuffle_block_rows", type=int, default=1024)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    parser.add_argument("--world_size", type=int, default=1, help="ranks the rows are split over")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write_folder(folder, args.rows)
        warm(folder)
        cfg = TrainConfig(data="criteo", data_path=folder, table_size_preset="mlperf", batch_size=args.batch_size,
                          shuffle=args.shuffle, shuffle_block_rows=args.shuffle_block_rows)
        data = CriteoClickLogs(cfg, folder, rank=0, world_size=args.world_size, pin_memory=False)
        steps = min(data.steps_per_epoch - 1, 200)
        results = {"train": [], "eval": []}
        for _ in range(args.repeats):
            results["train"].append(measure(data.train_batches(0), steps))
            evals = len(data._eval_ranges("val", 0)) - 1
            results["eval"].append(measure(data.eval_batches("val", 0), evals))
        print(f"rows {args.rows:,}, batch {args.batch_size}, world {args.world_size}, shuffle {args.shuffle} "
              f"(blocks of {args.shuffle_block_rows}), medians of {args.repeats}:")
        for name, values in results.items():
            wall = statistics.median(v[0] for v in values)
            cpu = statistics.median(v[1] for v in values)
            print(f"  {name:5s}: {wall / 1e6:6.2f} M samples/s (wall)   {cpu / 1e6:6.2f} M samples per CPU-second")


if __name__ == "__main__":
    main()
