"""Samples/s of the Criteo training loader (apps.dlrm.data.criteo.loader) in one process, from page cache.

    python benchmarks/criteo_loader.py                      # 4M rows, batch 8192, shuffled
    python benchmarks/criteo_loader.py --rows 20000000 --batch_size 16384 --no-shuffle
    python benchmarks/criteo_loader.py --device cuda --json loader.json   # delivered into the GPU

Writes a preprocessed folder of random rows in the documented layout (4 days), reads it once so
it is in the page cache, then times ``train_batches`` (and ``eval_batches``) of one rank the way
the training loop consumes them. Prints samples/s by the wall clock (with the background thread
assembling batches) and per CPU-second of the process. Target: >= 5M samples/s on one core, so
that a few loader cores feed 4M samples/s to an H100.

With ``--device cuda`` the batches are pinned, as the app pins them on GPUs, and each is copied
to the GPU as TorchRec's training pipeline copies it (``non_blocking`` on a side stream, the
consuming stream waiting for it), with one synchronization at the end of each timed loop: the
figure is samples/s delivered into the device, host-to-device copies included.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.core.data import RankShare  # noqa: E402
from apps.dlrm.config import train_config  # noqa: E402
from apps.dlrm.data.criteo.layout import ARRAYS, FORMAT, FORMAT_VERSION, array_file, day_report_file, write_json  # noqa: E402
from apps.dlrm.data.criteo.loader import CriteoClickLogs  # noqa: E402
from apps.dlrm.data.criteo.tables import TABLE_SIZE_PRESETS  # noqa: E402
from benchmarks import cli  # noqa: E402

DAYS = 4
ROW_BYTES = 4 * (13 + 26 + 1)  # float32 dense, int32 ids, int32 label


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
    write_json(
        os.path.join(folder, "manifest.json"),
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "categorical_ids": "hash",
            "num_embeddings_per_feature": sizes.tolist(),
            "days": names,
        },
    )


def warm(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


class HostBatches:
    """Consumes batches where the loader made them (``--device cpu``): nothing is copied."""

    def deliver(self, batch) -> int:
        return batch.labels.shape[0]

    def wait(self) -> None:
        pass


class DeviceBatches:
    """Copies each batch to ``device`` the way TorchRec's ``TrainPipelineSparseDist`` does.

    The copy is issued ``non_blocking`` on a side stream (the pipeline's memcpy stream); the
    consuming (current) stream waits for it and ``record_stream`` keeps the caching allocator
    from reusing the batch's memory before that stream is done with it. ``wait`` blocks until
    every copy issued so far has landed, so a timed loop ending with it counts delivered batches.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = torch.cuda.Stream(device)

    def deliver(self, batch) -> int:
        with torch.cuda.stream(self.copies):
            on_device = batch.to(self.device, non_blocking=True)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self.copies)
        on_device.record_stream(consumer)
        return batch.labels.shape[0]

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)


def measure(batches, count: int, sink) -> tuple[float, float]:
    """(samples/s wall, samples per CPU-second) of ``count`` batches handed to ``sink.deliver``."""
    sink.deliver(next(batches))  # start the thread, fill the queue, warm the device up
    sink.wait()
    samples = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        samples += sink.deliver(next(batches))
    sink.wait()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    batches.close()
    return samples / wall, samples / cpu


def make_sink(device: str):
    """The consumer of ``--device``; exits 2 with one line when CUDA is asked for and absent."""
    if device == "cpu":
        return HostBatches()
    if not torch.cuda.is_available():
        print(
            f"criteo_loader: --device cuda needs a CUDA GPU, and torch {torch.__version__} sees none "
            "here: run it on a GPU machine, or use --device cpu",
            file=sys.stderr,
        )
        sys.exit(2)
    return DeviceBatches(torch.device("cuda", torch.cuda.current_device()))


def medians(results: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """The median wall and CPU rates of each loop, under the names of the --json report."""
    figures = {}
    for name, values in results.items():
        figures[f"{name}_samples_per_sec"] = statistics.median(v[0] for v in values)
        figures[f"{name}_samples_per_cpu_sec"] = statistics.median(v[1] for v in values)
    return figures


def parse_args() -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--rows",
        type=int,
        default=4_000_000,
        help=f"rows of the generated folder, {ROW_BYTES} bytes each (the default 4M: "
        f"{4_000_000 * ROW_BYTES / 1e9:.2f} GB in the temporary folder); keep it "
        "well within free memory, or the figure is the disk's, not the loader's",
    )
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--shuffle_block_rows", type=int, default=1024)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    parser.add_argument("--world_size", type=int, default=1, help="ranks the rows are split over")
    cli.add_repeats(parser, 3, "measurements of each loop")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where batches are delivered: cpu (no copy) or cuda (pinned, copied to the GPU)",
    )
    cli.add_json(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sink = make_sink(args.device)
    with tempfile.TemporaryDirectory() as folder:
        write_folder(folder, args.rows)
        warm(folder)
        cfg = train_config(
            data="criteo",
            data_path=folder,
            table_size_preset="mlperf",
            batch_size=args.batch_size,
            shuffle=args.shuffle,
            shuffle_block_rows=args.shuffle_block_rows,
        )
        share = RankShare.of(cfg.training, 0, args.world_size)
        data = CriteoClickLogs(cfg.model, cfg.data, share, folder, pin_memory=args.device == "cuda")
        steps = min(data.steps_per_epoch - 1, 200)
        results = {"train": [], "eval": []}
        for _ in range(args.repeats):
            results["train"].append(measure(data.train_batches(0), steps, sink))
            evals = len(data._eval_ranges("val", 0)) - 1
            results["eval"].append(measure(data.eval_batches("val", 0), evals, sink))
    figures = medians(results)
    print(
        f"rows {args.rows:,}, batch {args.batch_size}, world {args.world_size}, shuffle {args.shuffle} "
        f"(blocks of {args.shuffle_block_rows}){', into cuda' if args.device == 'cuda' else ''}, "
        f"medians of {args.repeats}:"
    )
    for name in results:
        print(
            f"  {name:5s}: {figures[f'{name}_samples_per_sec'] / 1e6:6.2f} M samples/s (wall)   "
            f"{figures[f'{name}_samples_per_cpu_sec'] / 1e6:6.2f} M samples per CPU-second"
        )
    shape = {name: getattr(args, name) for name in ("device", "rows", "batch_size", "world_size", "shuffle", "repeats")}
    cli.write_report(args.json, {**shape, **figures})


if __name__ == "__main__":
    main()
