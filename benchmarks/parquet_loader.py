"""Samples/s of the Parquet training loader (--data parquet) against pyarrow's own dataset scanner
and its row-group reader, reading the same columns of the same files in the same run, from local
disk and from S3 (moto).

    python benchmarks/parquet_loader.py                         # 2M rows, batch 8192, local and S3
    python benchmarks/parquet_loader.py --targets local --rows 8000000 --json parquet.json

Writes Criteo-shaped Parquet files (label, 13 float32 dense columns, 26 int32 id columns below
MLPerf's table sizes, random values) in row groups of ``--row_group_rows``, to a temporary folder
(read once, so it is in the page cache) and to a bucket of an S3 server on loopback (moto, in a
process of its own). Then, after one measurement of each side that is not counted (the first
one of a process pays for its allocators' first pages and lazy imports), ``--repeats`` times and
alternately (ours first in even repeats, the scanner first in odd ones), it times ``--passes``
reads of the whole data set by

- ours: one rank's training batches (``train_batches``, ``--categorical_ids as_is``, shuffled as
  the app shuffles), as TorchRec ``Batch`` tensors the training loop would take, ``--passes``
  epochs one after another;
- the scanner: ``pyarrow.dataset``'s scanner over the same files and columns in batches of the same
  size, through pyarrow's own filesystems (its C++ S3 client for S3), once per pass: decoding
  only, no shuffle, no tensors, so it is a ceiling rather than a peer;
- row groups: ``pyarrow.parquet.ParquetFile.read_row_group`` over every row group of the files, in
  file order, as ours calls it to decode a window (the footers given, ``pre_buffer``): what ours
  costs before it shuffles and builds tensors, so that ours over it is the share of ours that is
  pyarrow's decoding, and the rest ours;

and prints the medians: samples/s by the wall clock, samples per CPU-second of this process (per
loader core: every thread's time counts, pyarrow's and s3fs's too) with the kernel's share of
that time, and ours over each of the others, with the range of that ratio over the repeats (each
repeat's sides taken in turn). moto runs in its own process, so its CPU time is not counted on
any side.

Why passes: ours reads the next window ahead (the next epoch's first at an epoch's end), as
training needs it; in a measurement of one epoch that window (an eighth of the default data set)
is decoded but never delivered, and each side's measurement lasted under a second, so the sides'
turns of the machine's load and of their allocators' page faults (the kernel zeroing fresh
pages: 0.05 to 0.64 s of system time for the same scan) moved the ratio 0.6-1.3 between runs.
"""

import argparse
import contextlib
import itertools
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterator
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.core.data import RankShare  # noqa: E402
from apps.dlrm.config import train_config  # noqa: E402
from apps.dlrm.data.criteo.tables import CAT_FEATURES, INT_FEATURES, TABLE_SIZE_PRESETS  # noqa: E402
from apps.dlrm.data.parquet.loader import ParquetClickLogs  # noqa: E402
from benchmarks import cli  # noqa: E402

TARGETS = ("local", "s3")
BASELINES = ("scanner", "row_groups")
BUCKET = "bench"
COLUMNS = ["label", *(f"int_{j}" for j in range(INT_FEATURES)), *(f"cat_{j}" for j in range(CAT_FEATURES))]


def write_files(folder: str, rows: int, files: int, group_rows: int) -> list[str]:
    rng = np.random.default_rng(0)
    sizes = TABLE_SIZE_PRESETS["mlperf"]
    paths = []
    for d in range(files):
        n = rows // files
        columns = {"label": rng.integers(0, 2, n).astype(np.int32)}
        columns.update({f"int_{j}": rng.random(n, dtype=np.float32) * 8 for j in range(INT_FEATURES)})
        columns.update({f"cat_{j}": rng.integers(0, sizes[j], n).astype(np.int32) for j in range(CAT_FEATURES)})
        paths.append(os.path.join(folder, f"day_{d}.parquet"))
        pq.write_table(pa.table(columns), paths[-1], row_group_size=group_rows)
        with open(paths[-1], "rb") as f:  # into the page cache
            while f.read(64 << 20):
                pass
    return paths


def timed(start: Callable[[], tuple[Iterator, int | None]]) -> tuple[float, float, float]:
    """(samples/s wall, samples per CPU-second, the share of that CPU time spent in the kernel)
    of a reader, from its first batch to its last. ``start()`` opens it (listing, footers: before
    the clocks start): a generator of one label column per batch, not yet begun, and how many to
    take (None: all). Its first batch counts: a reader that decodes ahead in threads (the scanner
    reads several files' row groups ahead) would otherwise do uncounted work before the clocks
    start. Its closing comes after they stop. The kernel's share is mostly fresh pages zeroed for
    the allocators, the part of a side's CPU time that moves most between measurements."""
    labels, count = start()
    samples = 0
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for batch in itertools.islice(labels, count):
        samples += len(batch)
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    labels.close()
    system = after.ru_stime - before.ru_stime
    cpu = after.ru_utime - before.ru_utime + system
    return samples / wall, samples / cpu, system / cpu


def ours(data_path: str, batch_size: int, passes: int) -> Callable[[], tuple[Iterator, int | None]]:
    """``passes`` epochs' worth of one rank's training batches."""
    cfg = train_config(
        data="parquet",
        data_path=data_path,
        table_size_preset="mlperf",
        batch_size=batch_size,
        categorical_ids="as_is",
        eval_fraction=0.01,
    )

    def start() -> tuple[Iterator, int | None]:
        data = ParquetClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training), pin_memory=False)
        batches = data.train_batches(0)

        def labels() -> Iterator:
            try:
                for batch in batches:
                    yield batch.labels
            finally:
                batches.close()  # stops the loader's threads

        return labels(), data.steps_per_epoch * passes

    return start


def scanner(
    files: list[str], filesystem: pafs.FileSystem, batch_size: int, passes: int
) -> Callable[[], tuple[Iterator, int | None]]:
    """Every batch of the files, as pyarrow's scanner decodes them, ``passes`` times."""

    def start() -> tuple[Iterator, int | None]:
        dataset = ds.dataset(files, format="parquet", filesystem=filesystem)
        # to_batches() starts reading ahead at once, so it is called at the first next(), as the clocks run.
        scans = (dataset.scanner(columns=COLUMNS, batch_size=batch_size) for _ in range(passes))
        return (batch.column(0) for scan in scans for batch in scan.to_batches()), None

    return start


def row_groups(files: list[str], filesystem: pafs.FileSystem, passes: int) -> Callable[[], tuple[Iterator, int | None]]:
    """Every row group of the files, decoded whole by pyarrow's Parquet reader, ``passes`` times."""

    def start() -> tuple[Iterator, int | None]:
        footers = [pq.read_metadata(path, filesystem=filesystem) for path in files]

        def labels() -> Iterator:
            for _ in range(passes):
                for path, footer in zip(files, footers):
                    with filesystem.open_input_file(path) as source:
                        reader = pq.ParquetFile(source, metadata=footer, pre_buffer=True)
                        for g in range(footer.num_row_groups):
                            yield reader.read_row_group(g, columns=COLUMNS).column(0)

        return labels(), None

    return start


@contextlib.contextmanager
def s3_bucket() -> Iterator[pafs.S3FileSystem]:
    """moto on loopback in a process of its own, the AWS variables pointing at it (for s3fs), and
    pyarrow's S3 filesystem for the same server."""
    from testing.moto_server import REGION, aws_env, moto_server

    with moto_server() as endpoint:
        os.environ.update(aws_env(endpoint))
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
        yield pafs.S3FileSystem(
            endpoint_override=urlparse(endpoint).netloc,
            scheme="http",
            region=REGION,
            access_key="testing",
            secret_key="testing",
        )


def measure(
    sides: dict[str, Callable[[], tuple[Iterator, int | None]]], repeats: int
) -> dict[str, list[tuple[float, float, float]]]:
    """Every side ``repeats`` times, reversing their order from one repeat to the next, after one
    uncounted measurement of each."""
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
    names = list(sides)
    for start in sides.values():
        timed(start)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(timed(sides[name]))
    return results


def figures(results: dict[str, list[tuple[float, float, float]]]) -> dict[str, float]:
    medians = {}
    for name, values in results.items():
        medians[f"{name}_samples_per_sec"] = statistics.median(v[0] for v in values)
        medians[f"{name}_samples_per_cpu_sec"] = statistics.median(v[1] for v in values)
        medians[f"{name}_system_share"] = statistics.median(v[2] for v in values)
    for baseline in BASELINES:
        for rate in ("samples_per_sec", "samples_per_cpu_sec"):
            medians[f"ours_over_{baseline}_{rate}"] = medians[f"ours_{rate}"] / medians[f"{baseline}_{rate}"]
        per_repeat = [o[1] / b[1] for o, b in zip(results["ours"], results[baseline])]
        medians[f"ours_over_{baseline}_samples_per_cpu_sec_min"] = min(per_repeat)
        medians[f"ours_over_{baseline}_samples_per_cpu_sec_max"] = max(per_repeat)
    return medians


def parse_args() -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of all files together")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row_group_rows", type=int, default=131_072)
    parser.add_argument("--batch_size", type=int, default=8192)
    cli.add_repeats(parser, 5, "measurements of each side, alternating; medians")
    parser.add_argument("--passes", type=cli.positive, default=3, help="reads of the whole data set per measurement")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help="comma separated: local (page cache), s3 (moto on loopback)"
    )
    cli.add_json(parser)
    args = parser.parse_args()
    args.targets = [t for t in TARGETS if t in args.targets.split(",")]
    if not args.targets:
        parser.error(f"--targets must name local, s3 or both, not {args.targets!r}")
    return args


def main() -> None:
    args = parse_args()
    report = {
        name: getattr(args, name) for name in ("rows", "files", "row_group_rows", "batch_size", "repeats", "passes")
    }
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        files = write_files(folder, args.rows, args.files, args.row_group_rows)
        sides = {}
        if "local" in args.targets:
            sides["local"] = {
                "ours": ours(folder, args.batch_size, args.passes),
                "scanner": scanner(files, pafs.LocalFileSystem(), args.batch_size, args.passes),
                "row_groups": row_groups(files, pafs.LocalFileSystem(), args.passes),
            }
        if "s3" in args.targets:
            s3 = stack.enter_context(s3_bucket())
            keys = [f"{BUCKET}/clicks/{os.path.basename(path)}" for path in files]
            for path, key in zip(files, keys):
                pafs.copy_files(path, key, destination_filesystem=s3)
            sides["s3"] = {
                "ours": ours(f"s3://{BUCKET}/clicks/", args.batch_size, args.passes),
                "scanner": scanner(keys, s3, args.batch_size, args.passes),
                "row_groups": row_groups(keys, s3, args.passes),
            }
        print(
            f"{args.rows:,} rows in {args.files} files, row groups of {args.row_group_rows:,}, batch "
            f"{args.batch_size}, {args.passes} passes a measurement, medians of {args.repeats}:"
        )
        for target, target_sides in sides.items():
            report[target] = figures(measure(target_sides, args.repeats))
            print_figures(target, list(target_sides), report[target])
    cli.write_report(args.json, report)


def print_figures(target: str, names: list[str], f: dict[str, float]) -> None:
    """A line of the :func:`figures` ``f`` of each side of ``target``, then one of ours over each baseline."""
    for name in names:
        print(
            f"  {target:5s} {name:10s}: {f[f'{name}_samples_per_sec'] / 1e6:6.2f} M samples/s (wall)  "
            f"{f[f'{name}_samples_per_cpu_sec'] / 1e6:6.2f} M samples per CPU-second "
            f"({f[f'{name}_system_share']:.0%} of it in the kernel)"
        )
    for baseline in BASELINES:
        ratio = f"ours_over_{baseline}"
        print(
            f"  {target:5s} ours / {baseline}: {f[f'{ratio}_samples_per_sec']:.2f} (wall), "
            f"{f[f'{ratio}_samples_per_cpu_sec']:.2f} (per CPU-second; {f[f'{ratio}_samples_per_cpu_sec_min']:.2f}"
            f"-{f[f'{ratio}_samples_per_cpu_sec_max']:.2f} over the repeats)"
        )


if __name__ == "__main__":
    main()
