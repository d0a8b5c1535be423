"""Checkpoint save/load throughput against raw fsspec I/O of the same bytes, in the same run.

    python benchmarks/checkpoint_io.py                # ~1 GB of tables, 2 ranks, local + S3
    python benchmarks/checkpoint_io.py --rows 250000  # smaller
    python benchmarks/checkpoint_io.py --targets local --reshard_to row_wise --json ckpt.json

The model's tables (8 x rows x 32 float32, ~1 GB at the default 1M rows) plus their
row-wise Adagrad state are saved with the app's checkpointing (sharded DCP + manifest +
commit marker) and loaded back, by 2 ranks, to a local directory and to an S3-compatible
server on loopback (moto). The baseline has each rank write, then read, the same number of
bytes as one plain fsspec file. Prints GB/s of each and the ratios (target >= 0.8).

What checksums cost (each shard block's CRC-32, taken as it is written and checked as it is
read), in the same run: the shards written by the app's writer against DCP's own writer with the
same planner (the app's saves before checksums), and the app's load of the same checkpoint with
its checksums against without them (as a checkpoint written before them loads). Printed as the
ratio of the median times, with over without.

Both sides are measured ``--repeats`` times (default 3), alternately (the checkpoint first in
even repeats, the baseline first in odd ones; with checksums first in even repeats, without first
in odd ones), and the medians are reported with every sample;
a ratio is the baseline's median time over the checkpoint's. They stand on equal footing: every
local write is on disk before it counts as done (the baseline fsyncs its file; the checkpoint's
writer fsyncs its shards, as the app's saves do), and before every local read the files about to
be read are dropped from the page cache (fsync, then ``posix_fadvise(DONTNEED)``: no root
needed), so both sides read the disk, as a job resumed on another host does. moto keeps every
object of more than 5 MB in a temporary file of its own process, read back whole for each
request, so on S3 both sides read from moto's temporary files (in the page cache) alike.

``--targets`` picks the locations; ``local`` alone needs neither moto nor boto3. Each rank
works on its own device: its GPU where CUDA is available (NCCL), else the CPU (gloo).

``--reshard_to SHARDING_TYPE`` (alone: row_wise) also loads each checkpoint, saved table_wise,
into a second model sharded that way, as a job resumed with another ``--sharding_type`` does:
timed as "reshard load", then every table is gathered whole from both models and compared
element for element. The saved tables hold random values of their own first, so the check
cannot pass by both models starting from the same seeded weights. Saving and loading go through
the app's ``Checkpointer``, as training does. A sharding the app refuses to build here (its
error says why) is reported with the app's message. A refused or unequal reshard exits 1, after the figures and
``--json`` are written.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.core.common.teardown import exit_without_teardown  # noqa: E402
from apps.core.config import SHARDING_TYPES  # noqa: E402  (light: the worker imports torch)
from benchmarks import cli  # noqa: E402
from benchmarks.moto_s3 import add_targets_argument, s3_bucket  # noqa: E402

SAVED_SHARDING = "table_wise"
DEFAULT_RESHARD = "row_wise"  # planned by the app on CPUs and GPUs; keeps the optimizer state


def bench_config(rows: int, sharding_type: str):
    """The benchmark's model: 8 tables of ``rows`` x 32, sharded ``sharding_type``, saved
    synchronously (the save's own throughput is measured, not the training's stall)."""
    from apps.dlrm.config import train_config

    return train_config(
        num_sparse_features=8,
        num_embeddings=rows,
        embedding_dim=32,
        dense_arch_layer_sizes=[64, 32],
        sharding_type=sharding_type,
        output_dir="",
        checkpoint_async=False,
    )


def timed(fn) -> float:
    """Collective. Seconds from the moment every rank is ready until every rank is done."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def evict(paths: list[str]) -> None:
    """Drops the files ``paths`` from the page cache: reading them next reads the disk. Their
    dirty pages are written first, since the kernel keeps those."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpointer(cfg, run, env):
    """Collective. The app's checkpointer of the trainer ``run`` at ``cfg.checkpoint.checkpoint_dir``, as training builds it."""
    from apps.core.checkpoint.checkpointer import Checkpointer, open_checkpoints

    return Checkpointer(cfg, env, open_checkpoints(cfg, env), run.checkpointed, run.run_length.steps)


def step_files(store, step: int) -> list[str]:
    """The local files of the checkpoint of ``step``."""
    folder = store.step_url(step)
    return [os.path.join(folder, name) for name in os.listdir(folder)]


def checkpoint_save(saver, step: int, env) -> float:
    """Collective. Seconds for the checkpointer ``saver`` to save and commit the checkpoint of ``step``."""
    from apps.core.checkpoint.checkpointer import TrainState

    return timed(lambda: saver.save(TrainState(env.rank, step, 0.0)))


def newest(store, env):
    """Collective. The newest committed checkpoint, as rank 0 finds it (the app's resume check)."""
    import torch.distributed as dist

    box = [store.newest() if env.is_main else None]
    dist.broadcast_object_list(box)
    return box[0]


def checkpoint_load(loader, checkpoint, local: bool, env) -> float:
    """Collective. Seconds for the checkpointer ``loader`` to restore ``checkpoint`` into its model
    and optimizer, from the disk where ``local``."""
    from apps.core.checkpoint.checkpointer import TrainState

    if local:
        evict(step_files(loader.store, checkpoint.step))
    return timed(lambda: loader.restore(TrainState(env.rank), checkpoint))


def shards_save(app, url: str, local: bool, summed: bool, env) -> float:
    """Collective. Seconds to write the shards of the checkpointer ``app``'s state under ``url`` with
    the app's writer, which checksums them as it writes, or (not ``summed``) DCP's own writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from apps.core.checkpoint.checkpointer import TrainState
    from apps.core.checkpoint.storage.saving import save_shards
    from apps.core.checkpoint.storage.writer import CheckpointSavePlanner

    state = app.entries(TrainState(env.rank, 0, 0.0))
    if summed:
        return timed(lambda: save_shards(state, url, local))
    writer = FsspecWriter(url, sync_files=local)
    return timed(lambda: dcp.save(state, storage_writer=writer, planner=CheckpointSavePlanner()))


def unchecked(checkpoint):
    """``checkpoint`` as one written before checksums: its manifest has none."""
    from apps.core.checkpoint.folder import CHECKSUMS

    return dataclasses.replace(checkpoint, manifest={k: v for k, v in checkpoint.manifest.items() if k != CHECKSUMS})


def shard_bytes(store, step: int, env) -> tuple[int, float]:
    """Collective. (bytes of this rank's shard files, GB of every rank's) of the checkpoint of ``step``."""
    import fsspec
    import torch
    import torch.distributed as dist

    fs, root = fsspec.core.url_to_fs(store.step_url(step))
    names = (os.path.basename(f) for f in fs.ls(root, detail=False))
    mine = sum(
        fs.size(f"{root}/{name}") for name in names if name.startswith(f"__{env.rank}_") and name.endswith(".distcp")
    )
    total = torch.tensor([mine], dtype=torch.float64, device=env.device)  # NCCL reduces on the GPU
    dist.all_reduce(total)
    return mine, total.item() / 1e9


def raw_write(path: str, payload: bytes, local: bool) -> float:
    """Collective. Seconds for every rank to write its ``payload`` as one fsspec file, on disk where ``local``."""
    import fsspec

    def write() -> None:
        with fsspec.open(path, "wb") as f:
            f.write(payload)
            if local:
                f.flush()
                os.fsync(f.fileno())

    return timed(write)


def raw_read(path: str, local: bool) -> float:
    """Collective. Seconds for every rank to read its file of :func:`raw_write`, from the disk where ``local``."""
    import fsspec

    if local:
        evict([path])

    def read() -> None:
        with fsspec.open(path, "rb") as f:
            f.read()

    return timed(read)


def in_turn(repeat: int, first: str, second: str) -> tuple[str, str]:
    """The order of two sides in ``repeat``: alternating, ``first`` first in even repeats."""
    return (first, second) if repeat % 2 == 0 else (second, first)


RATES = ("save", "raw_write", "load", "raw_read")
#: Each ratio of medians: (its name, the numerator's side, the denominator's). The checksums' are
#: costs (with over without: 1.0 is free), the others rates against the raw baseline.
RATIOS = (
    ("save_ratio", "raw_write", "save"),
    ("load_ratio", "raw_read", "load"),
    ("checksum_save_cost", "summed_save", "unsummed_save"),
    ("checksum_load_cost", "checked_load", "unchecked_load"),
)


def summary(gb: float, seconds: dict[str, list[float]]) -> dict:
    """The report of one location: GB/s medians, the ratios of medians, and every sample."""
    median = {name: statistics.median(values) for name, values in seconds.items()}
    figures = {f"{name}_gbps": gb / median[name] for name in seconds}
    figures.update({ratio: median[top] / median[bottom] for ratio, top, bottom in RATIOS})
    samples = {f"{name}_gbps": [gb / s for s in seconds[name]] for name in seconds}
    samples.update({ratio: [t / b for t, b in zip(seconds[top], seconds[bottom])] for ratio, top, bottom in RATIOS})
    return {"gb": gb, "repeats": len(seconds["save"]), **figures, "samples": samples}


# --- --reshard_to --------------------------------------------------------------------------------


@dataclass
class Resharded:
    """The second model of --reshard_to (its config and training run), or the app's refusal."""

    sharding_type: str
    cfg: Any = None
    run: Any = None
    error: str = ""


def build_resharded(rows: int, sharding_type: str, env) -> Resharded:
    """Collective. The benchmark's model sharded ``sharding_type``, as the app builds it."""
    from apps.core.common.errors import ConfigError
    from apps.dlrm.training.app import Trainer

    try:
        cfg = bench_config(rows, sharding_type)
        return Resharded(sharding_type, cfg, Trainer(cfg, env))
    except ConfigError as e:
        return Resharded(sharding_type, error=str(e))


def table_weights(run) -> dict:
    """Table name -> its weight in the model's state dict: a ShardedTensor of this rank's shards."""
    from apps.core.training.sharding import plan_tables
    from apps.dlrm.model import EBC_PATH

    state = run.model.state_dict()
    return {table: state[f"{EBC_PATH}.embedding_bags.{table}.weight"] for table in plan_tables(run.plan)}


def scramble(run) -> None:
    """Fills every table with random values of its own (seeded by table, so on any sharding)."""
    import torch

    for index, weight in enumerate(table_weights(run).values()):
        for shard in weight.local_shards():
            generator = torch.Generator(device=shard.tensor.device).manual_seed(1000 + index)
            shard.tensor.uniform_(-1, 1, generator=generator)


def gathered(weight, env):
    """Collective. The whole tensor of the ShardedTensor ``weight`` on rank 0, None elsewhere."""
    import torch

    dtype = weight.metadata().tensor_properties.dtype
    out = torch.empty(tuple(weight.metadata().size), dtype=dtype, device=env.device) if env.is_main else None
    weight.gather(dst=0, out=out, dtype=dtype)
    return out


def tables_equal(saved, resharded, env) -> bool:
    """Collective. Whether every table of ``resharded`` equals ``saved``'s, element for element.

    Tables are gathered whole on rank 0 one at a time, so the memory needed is a few tables.
    """
    import torch
    import torch.distributed as dist

    theirs = table_weights(resharded)
    equal = True
    for table, weight in table_weights(saved).items():
        mine, other = gathered(weight, env), gathered(theirs[table], env)
        equal = equal and (not env.is_main or torch.equal(mine, other))
    box = [equal]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reshard(checkpoint, saved, target: Resharded, gb: float, repeats: int, local: bool, env) -> dict:
    """Collective. Loads ``checkpoint`` into ``target``'s model ``repeats`` times (from the disk
    where ``local``): its figures for the report (the median rate, every sample)."""
    from apps.core.common.errors import ConfigError

    figures = {"reshard_to": target.sharding_type, "reshard_load_gbps": None, "reshard_equal": False}
    if target.error:
        return {**figures, "reshard_error": target.error}
    target.cfg.checkpoint.checkpoint_dir = os.path.dirname(checkpoint.url)
    loader = checkpointer(target.cfg, target.run, env)
    try:  # refused before any collective, alike on every rank
        rates = [gb / checkpoint_load(loader, checkpoint, local, env) for _ in range(repeats)]
    except ConfigError as e:
        return {**figures, "reshard_error": str(e)}
    return {
        **figures,
        "reshard_load_gbps": statistics.median(rates),
        "samples": {"reshard_load_gbps": rates},
        "reshard_equal": tables_equal(saved, target.run, env),
    }


# --- the ranks ---------------------------------------------------------------------------------


def measure(url: str, run, cfg, target: Resharded | None, repeats: int, env) -> dict:
    """Collective. The figures of one location (the --json report's entry for it)."""
    # Every save and raw write makes new files, and none is deleted while measuring (a save
    # beyond --keep_last would also time the deletion of the oldest checkpoint).
    cfg.checkpoint.checkpoint_dir, cfg.checkpoint.keep_last = url, repeats
    app = checkpointer(cfg, run, env)
    local = "://" not in url
    seconds: dict[str, list[float]] = {name: [] for _, *sides in RATIOS for name in sides}
    payload, gb = b"", 0.0
    for repeat in range(repeats):
        raw = f"{url}/raw/rank{env.rank}.{repeat}.bin"
        for name in in_turn(repeat, "save", "raw_write"):
            if name == "raw_write":
                seconds[name].append(raw_write(raw, payload, local))
                continue
            seconds[name].append(checkpoint_save(app, repeat + 1, env))
            if not payload:  # repeat 0 saves first: the baseline then writes as many bytes
                size, gb = shard_bytes(app.store, repeat + 1, env)
                payload = (os.urandom(2**20) * (size // 2**20 + 1))[:size]
        checkpoint = newest(app.store, env)
        for name in in_turn(repeat, "load", "raw_read"):
            load = name == "load"
            seconds[name].append(checkpoint_load(app, checkpoint, local, env) if load else raw_read(raw, local))
        for name in in_turn(repeat, "summed_save", "unsummed_save"):
            folder = f"{url}/shards/{repeat}-{name}"
            seconds[name].append(shards_save(app, folder, local, name == "summed_save", env))
        for name in in_turn(repeat, "checked_load", "unchecked_load"):
            loaded = checkpoint if name == "checked_load" else unchecked(checkpoint)
            seconds[name].append(checkpoint_load(app, loaded, local, env))
    figures = summary(gb, seconds)
    if target is not None:
        resharded = reshard(checkpoint, run, target, gb, repeats, local, env)
        figures["samples"].update(resharded.pop("samples", {}))
        figures.update(resharded)
    return figures


def describe(target: str, f: dict) -> str:
    """The figures printed for ``target``: a line of medians (plus the reshard's), a line of samples."""
    samples = " | ".join(f"{name} " + " ".join(f"{v:.3f}" for v in values) for name, values in f["samples"].items())
    return f"{medians_line(target, f)}\n  samples: {samples}"


def medians_line(target: str, f: dict) -> str:
    line = (
        f"{target}: {f['gb']:.2f} GB of shards, medians of {f['repeats']} | "
        f"save {f['save_gbps']:.3f} GB/s vs raw write {f['raw_write_gbps']:.3f} GB/s = {f['save_ratio']:.2f} | "
        f"load {f['load_gbps']:.3f} GB/s vs raw read {f['raw_read_gbps']:.3f} GB/s = {f['load_ratio']:.2f} | "
        f"checksums: shards written {f['summed_save_gbps']:.3f} GB/s vs {f['unsummed_save_gbps']:.3f} without, "
        f"time x{f['checksum_save_cost']:.3f}; loaded {f['checked_load_gbps']:.3f} GB/s vs "
        f"{f['unchecked_load_gbps']:.3f} unchecked, time x{f['checksum_load_cost']:.3f}"
    )
    if "reshard_error" in f:
        return f"{line} | reshard to {f['reshard_to']} FAILED: {f['reshard_error']}"
    if "reshard_to" in f:
        return (
            f"{line} | reshard load to {f['reshard_to']} {f['reshard_load_gbps']:.3f} GB/s, "
            f"tables equal: {f['reshard_equal']}"
        )
    return line


def worker(urls: list[str], rows: int, reshard_to: str | None, repeats: int, results: str) -> None:
    """Runs under torchrun: measures each URL; rank 0 prints the figures and writes ``results``."""
    import torch.distributed as dist

    from apps.core.common.distributed import init_distributed
    from apps.dlrm.training.app import Trainer

    env = init_distributed()
    cfg = bench_config(rows, SAVED_SHARDING)
    run = Trainer(cfg, env)
    target = None
    if reshard_to:
        scramble(run)
        target = build_resharded(rows, reshard_to, env)
    report = {}
    for url in urls:
        name = url.split(":")[0] if "://" in url else "local"
        report[name] = measure(url, run, cfg, target, repeats, env)
        if env.is_main:
            print(describe(name, report[name]), flush=True)
    if env.is_main:
        cli.write_report(results, report)
    dist.destroy_process_group()


# --- the launcher ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each of the 8 tables")
    cli.add_nproc(parser)
    cli.add_repeats(parser, 3, "measurements of each side, alternating; medians are reported")
    add_targets_argument(parser)
    parser.add_argument(
        "--reshard_to",
        nargs="?",
        const=DEFAULT_RESHARD,
        choices=SHARDING_TYPES,
        metavar="SHARDING_TYPE",
        help=f"also load each checkpoint (saved {SAVED_SHARDING}) into a model sharded "
        f"this way and check its tables equal the saved ones (alone: {DEFAULT_RESHARD})",
    )
    cli.add_json(parser, "the figures of each target")
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    return parser.parse_args()


def launch(opts: argparse.Namespace, folder: str, env: dict[str, str], urls: list[str]) -> dict:
    """Runs the ranks under torchrun; returns the figures rank 0 reported."""
    results = os.path.join(folder, "results.json")
    reshard = ["--reshard_to", opts.reshard_to] if opts.reshard_to else []
    subprocess.run(
        cli.torchrun_command(
            opts.nproc,
            os.path.abspath(__file__),
            "--rows",
            str(opts.rows),
            "--repeats",
            str(opts.repeats),
            *reshard,
            "--results",
            results,
            "--worker",
            *urls,
        ),
        env=cli.rank_env(OMP_NUM_THREADS="1", **env),
        check=True,
    )
    with open(results) as f:
        return json.load(f)


def main() -> None:
    opts = parse_args()
    if opts.worker is not None:
        worker(opts.worker, opts.rows, opts.reshard_to, opts.repeats, opts.results)
        return
    with (
        tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as local,
        contextlib.ExitStack() as stack,
    ):
        env = stack.enter_context(s3_bucket("bench")) if "s3" in opts.targets else {}
        urls = [{"local": os.path.join(local, "ckpt"), "s3": "s3://bench/ckpt"}[t] for t in opts.targets]
        print(f"tables: 8 x {opts.rows:,} x 32 float32 + row-wise Adagrad state, {opts.nproc} ranks", flush=True)
        report = launch(opts, local, env, urls)
    cli.write_report(opts.json, report)
    failed = [target for target, figures in report.items() if figures.get("reshard_equal") is False]
    if failed:
        sys.exit(
            f"checkpoint_io: the checkpoint at {', '.join(failed)} did not load resharded "
            f"{opts.reshard_to} with equal tables (see above)"
        )


if __name__ == "__main__":
    exit_without_teardown(main)
