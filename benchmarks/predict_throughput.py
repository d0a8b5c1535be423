"""Scoring throughput per CPU core of exported packages against the training job's own evaluation
loop on the same rows, in the same run; and export time per GB of tables.

    python benchmarks/predict_throughput.py                      # 4 files x 131,072 rows, 26 x 200,000-row tables
    python benchmarks/predict_throughput.py --num_embeddings 1000000 --json predict.json

Writes Criteo-shaped Parquet click logs (testing/click_parquet.py) to a temporary folder, saves a
checkpoint of a DLRM after one training step (its weights do not change the timings), and then:

- export: ``python -m apps.dlrm.export``'s work in this process, float32 and int8, timed from the
  checkpoint to the package written: seconds per GB of the trained (float32) tables;
- the training job's evaluation loop (testing/training_scores.py, in a process of its own, one
  intra-op thread): the sharded model restored from the checkpoint, batches from the training
  loader, over the test split (the last file's second half);
- scoring the same rows in this process, one intra-op thread: the split (in memory) decoded as
  training decodes it and scored ``--batch_size`` rows at a time (apps.dlrm.serving.features), by
  the float32 and int8 packages' programs, the checkpoint's eager model, and TorchScript programs
  of the same float32 and int8 modules (torchrec.fx.symbolic_trace + torch.jit.script: the format
  that was not chosen, measured here so the choice can be checked); and each module alone on the
  inputs already made (``module_only``: what the program format itself costs);
- ``python -m apps.dlrm.predict`` on one rank over every file (reading, scoring and writing
  Parquet), the rows/s its report gives.

Rates are rows per second of wall time with one intra-op thread, and rows per CPU-second of the
process (every thread's time: the loaders' too): per core, and what to compare on a machine whose
cores other work shares (wall time then counts the waits). Medians of ``--repeats``.
"""

import argparse
import copy
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apps.dlrm.data.parquet.loader import assemble_batch  # noqa: E402
from apps.dlrm.serving.api import Model, load_model  # noqa: E402
from apps.dlrm.serving.config import ExportConfig  # noqa: E402
from apps.dlrm.serving.export import export  # noqa: E402
from apps.dlrm.serving.features import RowScorer  # noqa: E402
from apps.dlrm.serving.program import quantize_tables  # noqa: E402
from benchmarks import cli  # noqa: E402
from testing.click_parquet import write_click_parquet  # noqa: E402


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rows_per_file", type=int, default=131_072)
    parser.add_argument("--num_embeddings", type=int, default=200_000)
    parser.add_argument("--batch_size", type=int, default=8192, help="rows per batch, evaluation and scoring")
    cli.add_repeats(parser, 3)
    cli.add_json(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(args, tmp)
    for name, value in figures.items():
        print(f"{name:44s} {value:,.3f}" if isinstance(value, float) else f"{name:44s} {value}")
    cli.write_report(args.json, figures)


def measure(args: argparse.Namespace, tmp: str) -> dict:
    data = write_click_parquet(
        os.path.join(tmp, "data"),
        args.files,
        args.rows_per_file,
        row_group_rows=16_384,
        num_embeddings=args.num_embeddings,
    )
    ckpt = os.path.join(tmp, "ckpt")
    training = ["--data", "parquet", "--data_path", data, "--num_embeddings", str(args.num_embeddings)]
    training += ["--batch_size", str(args.batch_size), "--checkpoint_dir", ckpt, "--output_dir", ""]
    app(["-m", "apps.dlrm.train", *training, "--steps", "1", "--val_batches", "1", "--test_batches", "1"])
    figures: dict = {"rows_scored": args.rows_per_file // 2, "batch_size": args.batch_size, "threads": 1}
    for quantize in ("none", "int8"):
        start = time.perf_counter()
        manifest = export(ExportConfig(checkpoint_dir=ckpt, output=os.path.join(tmp, quantize), quantize=quantize))
        seconds = time.perf_counter() - start
        tables = manifest["tables"]
        figures[f"export_{quantize}_seconds"] = seconds
        figures[f"export_{quantize}_seconds_per_trained_gb"] = seconds / (tables["trained_bytes"] / 1e9)
        figures[f"package_{quantize}_table_mb"] = tables["package_bytes"] / 1e6
    figures["trained_table_mb"] = tables["trained_bytes"] / 1e6
    figures["int8_table_reduction"] = tables["trained_bytes"] / tables["package_bytes"]

    scores = os.path.join(tmp, "own.npz")
    evaluation = [*training, "--evaluate_checkpoint", "latest", "--test_batches", "0"]
    for _ in range(args.repeats):
        app(["-m", "testing.training_scores", "--out", scores, *evaluation])
        own = np.load(scores)
        figures.setdefault("_eval", []).append(
            (len(own["scores"]) / own["seconds"], len(own["scores"]) / own["cpu_seconds"])
        )
    figures["eval_loop_rows_per_sec"] = statistics.median(wall for wall, _ in figures["_eval"])
    figures["eval_loop_rows_per_cpu_sec"] = statistics.median(cpu for _, cpu in figures.pop("_eval"))

    last = pq.read_table(os.path.join(data, f"day_{args.files - 1}.parquet"))
    split = last.slice(args.rows_per_file // 2)
    models = {
        "package_fp32": load_model(os.path.join(tmp, "none")),
        "package_int8": load_model(os.path.join(tmp, "int8")),
    }
    models["checkpoint_eager"] = load_model(ckpt, step="latest")
    models.update(torchscript_models(ckpt, figures))
    batches = program_inputs(models["package_fp32"], split, args.batch_size)
    for name, model in models.items():
        wall, cpu = rates(lambda model=model: scored(model, split, args.batch_size), split.num_rows, args.repeats)
        figures[f"{name}_rows_per_sec"], figures[f"{name}_rows_per_cpu_sec"] = wall, cpu
        figures[f"{name}_over_eval_loop_per_cpu_sec"] = cpu / figures["eval_loop_rows_per_cpu_sec"]
        _, figures[f"{name}_module_only_rows_per_cpu_sec"] = rates(
            lambda model=model: called(model, batches), split.num_rows, args.repeats
        )

    output = os.path.join(tmp, "scores")
    app(["-m", "apps.dlrm.predict", "--model", os.path.join(tmp, "none"), "--data_path", data, "--output", output])
    with open(os.path.join(output, "report.json")) as f:
        figures["predict_job_1_rank_rows_per_sec"] = json.load(f)["rows_per_second"]
    return figures


def app(args: list[str]) -> None:
    """Runs ``python ARGS`` with one intra-op thread; its failure ends the benchmark."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    }
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(f"predict_throughput: {' '.join(args[:2])} failed:\n{result.stderr[-4000:]}")


def scored(model: Model, table, batch_rows: int) -> None:
    model(table, batch_rows=batch_rows)


def program_inputs(model: Model, table, batch_rows: int) -> list[tuple[torch.Tensor, ...]]:
    """The program's inputs of ``table``'s rows, ``batch_rows`` at a time, as scoring makes them."""
    spec = model.features.spec([("split", table.schema)])
    rows = RowScorer(model.module, model.features, spec, batch_rows)
    decoded = rows.decode(table.select(spec.names), "split")
    inputs = []
    for lo in range(0, len(decoded), batch_rows):
        run = np.array([[lo, min(lo + batch_rows, len(decoded))]])
        batch = assemble_batch([(decoded, run)], model.features.keys, model.features.num_dense_features, torch.int64)
        inputs.append((batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths()))
    return inputs


@torch.no_grad()
def called(model: Model, batches: list[tuple[torch.Tensor, ...]]) -> None:
    """The model's module alone, on inputs already made: the program format's own cost."""
    for batch in batches:
        model.module(*batch)


def rates(run: Callable[[], None], rows: int, repeats: int) -> tuple[float, float]:
    """Median (rows/s of wall time, rows per CPU-second) of ``run`` after one warm-up."""
    run()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(rows / (time.perf_counter() - wall))
        cpus.append(rows / (time.process_time() - cpu))
    return statistics.median(walls), statistics.median(cpus)


def torchscript_models(ckpt: str, figures: dict) -> dict[str, Model]:
    """TorchScript programs of the checkpoint's float32 and int8 modules (torchrec.fx.symbolic_trace,
    torch.jit.script), round-tripped through torch.jit.save/load; their export seconds and bytes."""
    import torchrec.fx

    eager = load_model(ckpt, step="latest")
    models = {}
    for quantize in ("none", "int8"):
        module = copy.deepcopy(eager.module)
        quantize_tables(module.dlrm, quantize)
        start = time.perf_counter()
        scripted = torch.jit.script(torchrec.fx.symbolic_trace(module))
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        figures[f"torchscript_{quantize}_export_seconds"] = time.perf_counter() - start
        figures[f"torchscript_{quantize}_mb"] = len(buffer.getvalue()) / 1e6
        buffer.seek(0)
        name = "fp32" if quantize == "none" else quantize
        models[f"torchscript_{name}"] = Model(torch.jit.load(buffer), eager.features, eager.manifest)
    return models


if __name__ == "__main__":
    main()
