"""``--categorical_ids zch`` against ``hash`` on raw ids with a planted signal (docs/data.md's figure).

Writes click logs of raw ids (:mod:`testing.raw_ids`: 3 columns of 50-bit and text ids, a
power law of popularity, an effect per id), trains the DLRM on one CPU rank with each kind of
table, and reports per run: validation AUROC, steady training throughput (samples per second, the
summary's), and how many of the ids seen in training got a row of their own (hash: ids alone in
their row among those seen; zch: the ids the managed-collision map holds at the end) with the
share of validation lookups that found one. Hashing on one rank runs the lean step (FBGEMM's kernels
called directly); ``hash_sharded`` takes TorchRec's sharded step, row-wise, as zch must, so that
the throughput cost of zch itself is the difference between those two.

    python -m benchmarks.zch_vs_hash --folder /tmp/zch_bench [--rows 200000 --distinct 70000]
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from apps.core.common.hashing import mix64
from apps.core.zch.config import INPUT_HASH_SIZE
from apps.dlrm.data.parquet.read import _id_values
from apps.dlrm.serving.trained import load_trained
from testing.raw_ids import write_raw_id_parquet

FILES = 5
MODEL = [
    "--num_dense_features", "2", "--num_sparse_features", "3", "--embedding_dim", "16",
    "--dense_arch_layer_sizes", "32,16", "--over_arch_layer_sizes", "32,1",
    "--batch_size", "1024", "--val_batches", "0", "--test_batches", "0", "--log_every", "1000",
]  # fmt: skip
#: name -> the options of its run
RUNS = {
    "hash_4096": ["--categorical_ids", "hash", "--num_embeddings", "4096"],
    "hash_sharded_4096": ["--categorical_ids", "hash", "--num_embeddings", "4096", "--lean_step", "false",
                          "--sharding_type", "row_wise"],
    "zch_4096": ["--categorical_ids", "zch", "--num_embeddings", "4096"],
    "zch_4096_interval_100": ["--categorical_ids", "zch", "--num_embeddings", "4096", "--zch_eviction_interval", "100"],
    "hash_1000000": ["--categorical_ids", "hash", "--num_embeddings", "1000000"],
}  # fmt: skip


def keys(folder: str, files: list[int], column: str, rows: slice = slice(None)) -> np.ndarray:
    """The 64-bit mixes of ``column``'s values in ``files`` (as training hashes them before any modulo)."""
    values = np.concatenate([_id_values(pq.read_table(f"{folder}/day_{f}.parquet").column(column).combine_chunks())
                             for f in files])[rows]  # fmt: skip
    bits = values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64)
    return mix64(torch.from_numpy(bits)).numpy().view(np.uint64)


def own_rows_hash(train: np.ndarray, val: np.ndarray, size: int) -> tuple[int, float]:
    """Ids seen that are alone in their row among the ids seen, and the share of validation lookups of them."""
    seen = np.unique(train)
    buckets, counts = np.unique(seen % np.uint64(size), return_counts=True)
    alone = np.isin(seen % np.uint64(size), buckets[counts == 1])
    own = seen[alone]
    return len(own), float(np.isin(val, own).mean())


def own_rows_zch(train: np.ndarray, val: np.ndarray, held: np.ndarray) -> tuple[int, float]:
    """Ids seen that the map holds, and the share of validation lookups of them."""
    seen = np.unique(train % np.uint64(INPUT_HASH_SIZE))
    return int(np.isin(seen, held).sum()), float(np.isin(val % np.uint64(INPUT_HASH_SIZE), held).mean())


def held_ids(checkpoint_dir: str) -> dict[str, np.ndarray]:
    """Per table, the ids the zch maps of the checkpoint hold (loaded as export loads it)."""
    model = load_trained(checkpoint_dir, "latest").model
    held = {}
    for module in model.modules():
        if isinstance(module, MCHManagedCollisionModule):
            ids = module._mch_sorted_raw_ids
            held[module._name] = ids[ids != torch.iinfo(torch.int64).max].numpy().astype(np.uint64)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--distinct", type=int, default=70_000, help="vocabulary per column")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args()
    data = os.path.join(args.folder, "data")
    if not os.path.exists(data):
        write_raw_id_parquet(data, rows=args.rows, files=FILES, distinct=args.distinct, row_group_rows=8192)
    rows_per_file = args.rows // FILES
    val_rows = slice(0, rows_per_file // 2)  # --eval_days 1: the first half of the last file validates
    columns = ["cat_0", "cat_1", "cat_2"]
    train = {c: keys(data, list(range(FILES - 1)), c) for c in columns}
    val = {c: keys(data, [FILES - 1], c, val_rows) for c in columns}
    print("distinct ids seen in training per column:", [len(np.unique(train[c])) for c in columns])
    results = {}
    for name in args.runs.split(","):
        out, ckpt = os.path.join(args.folder, name), os.path.join(args.folder, f"{name}_ckpt")
        command = [sys.executable, "-m", "apps.dlrm.train", "--data", "parquet", "--data_path", data, *MODEL,
                   *RUNS[name], "--epochs", str(args.epochs), "--output_dir", out, "--checkpoint_dir", ckpt,
                   "--checkpoint_every", "0"]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        size = int(RUNS[name][RUNS[name].index("--num_embeddings") + 1])
        if "zch" in name:
            held = held_ids(ckpt)
            own = [own_rows_zch(train[c], val[c], held[f"t_{c}"]) for c in columns]
        else:
            own = [own_rows_hash(train[c], val[c], size) for c in columns]
        results[name] = {
            "val_auroc": round(summary["val_auroc"], 4),
            "samples_per_sec": round(summary["samples_per_sec"]),
            "ids_with_own_rows": [n for n, _ in own],
            "val_lookups_on_own_rows": [round(share, 3) for _, share in own],
        }
        print(name, json.dumps(results[name]), flush=True)
    with open(os.path.join(args.folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
