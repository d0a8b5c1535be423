"""Criteo preprocessing rows/s per core: ours against TorchRec's ``tsv_to_npys``, same file, same run.

    python benchmarks/criteo_preprocess.py                  # 300k generated rows, 3 runs each
    python benchmarks/criteo_preprocess.py --rows 1000000 --repeats 5

Generates a Criteo-format day (real rows may not be redistributed), then alternates: our
conversion of the day (apps.dlrm.data.criteo.convert, Arrow on one thread) and TorchRec's
``BinaryCriteoUtils.tsv_to_npys`` on the same file. Both are timed by the CPU time of the
process, so the figures are per core and hold on a busy machine. Prints the medians and their
ratio (target >= 10). Then the peak memory of our conversion of the day and of a day 4 times as
long (streaming: it must not grow with the file), and the wall-clock rows/s of the whole
preprocessing (all cores) over 4 copies of the day.
"""

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from apps.dlrm.data.criteo.config import PreprocessConfig  # noqa: E402
from apps.dlrm.data.criteo.pipeline import preprocess  # noqa: E402
from benchmarks import cli  # noqa: E402
from testing.criteo_files import generate_day, write_day  # noqa: E402

# Our conversion alone, in a fresh process: prints its peak resident memory in MB (VmHWM, which,
# unlike ru_maxrss, does not count the parent's memory that the child held before exec).
_PEAK_MEMORY = """
import sys
import pyarrow as pa
from apps.dlrm.data.criteo.convert import convert_day
from apps.dlrm.data.criteo.sources import Source
pa.set_cpu_count(1)
convert_day(Source(sys.argv[1], "day", 0), sys.argv[2], [40_000_000] * 26, lambda n: None)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]) / 1024)
"""


def ours(path: str, out: str) -> float:
    """Rows per CPU-second of our conversion of ``path`` (one Arrow thread: one core)."""
    import pyarrow as pa

    from apps.dlrm.data.criteo.convert import convert_day
    from apps.dlrm.data.criteo.sources import Source

    pa.set_cpu_count(1)
    start = time.process_time()
    report = convert_day(Source(path, "day", 0), out, [40_000_000] * 26, lambda n: None)
    return report["rows_written"] / (time.process_time() - start)


def torchrec(path: str, out: str, rows: int) -> float:
    """Rows per CPU-second of TorchRec's tsv_to_npys on ``path``."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BinaryCriteoUtils.tsv_to_npys(path, *(os.path.join(out, f"tr_{p}.npy") for p in ("dense", "sparse", "labels")))
    return rows / (time.process_time() - start)


def peak_memory_mb(path: str, out: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_MEMORY, path, out],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(HERE),
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--rows", type=int, default=300_000)
    cli.add_repeats(parser, 3, "runs of each side, alternating")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        day = write_day(generate_day(args.rows, seed=0, malformed=False, cat_pool=100_000), os.path.join(tmp, "day_0"))
        size_mb = os.path.getsize(day) / 1e6
        results: dict[str, list[float]] = {"ours": [], "torchrec": []}
        for _ in range(args.repeats):
            results["ours"].append(ours(day, tmp))
            results["torchrec"].append(torchrec(day, tmp, args.rows))
        mine, theirs = statistics.median(results["ours"]), statistics.median(results["torchrec"])
        print(f"{args.rows:,} rows ({size_mb:.0f} MB), medians of {args.repeats} alternating runs, per core:")
        print(f"  ours (Arrow + numpy):        {mine:>10,.0f} rows/s")
        print(f"  TorchRec tsv_to_npys:        {theirs:>10,.0f} rows/s")
        print(f"  ratio:                       {mine / theirs:10.1f}x")

        long_day = os.path.join(tmp, "long_day")
        with open(long_day, "wb") as out:
            for _ in range(4):
                with open(day, "rb") as src:
                    shutil.copyfileobj(src, out)
        print(
            f"peak memory of our conversion: {peak_memory_mb(day, tmp):.0f} MB for {size_mb:.0f} MB of text, "
            f"{peak_memory_mb(long_day, tmp):.0f} MB for {4 * size_mb:.0f} MB"
        )
        os.remove(long_day)

        inputs = os.path.join(tmp, "inputs")
        os.makedirs(inputs)
        for d in range(4):
            shutil.copy(day, os.path.join(inputs, f"day_{d}"))
        start = time.perf_counter()
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = preprocess(
            PreprocessConfig(input=[inputs], output=os.path.join(tmp, "out"), table_size_preset="mlperf")
        )
        wall = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
        cores = len(os.sched_getaffinity(0))
        print(
            f"whole preprocessing, 4 days on {cores} cores: {report['rows_written'] / wall:,.0f} rows/s wall, "
            f"{report['rows_written'] / cpu:,.0f} rows per worker CPU-second (with process start-up)"
        )


if __name__ == "__main__":
    main()
