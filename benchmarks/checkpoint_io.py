"""Checkpoint save/load throughput against raw fsspec I/O of the same bytes, in the same run.

    python benchmarks/checkpoint_io.py                # ~1 GB of tables, 2 ranks, local + S3
    python benchmarks/checkpoint_io.py --rows 250000  # smaller

The model's tables (8 x rows x 32 float32, ~1 GB at the default 1M rows) plus their
row-wise Adagrad state are saved with the app's checkpointing (sharded DCP + manifest +
commit marker) and loaded back, by 2 ranks, to a local directory and to an S3-compatible
server on loopback (moto). The baseline has each rank write, then read, the same number of
bytes as one plain fsspec file. Prints GB/s of each and the ratios (target >= 0.8).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(urls: list[str], rows: int) -> None:
    """Runs under torchrun: measures checkpoint and raw I/O at each URL."""
    import fsspec
    import torch
    import torch.distributed as dist

    from apps.dlrm.checkpoint import open_checkpoints, restore, save
    from apps.dlrm.config import TrainConfig
    from apps.dlrm.distributed import init_distributed
    from apps.dlrm.sharding import plan_tables
    from apps.dlrm.train import build_training

    env = init_distributed()
    cfg = TrainConfig(num_sparse_features=8, num_embeddings=rows, embedding_dim=32,
                      dense_arch_layer_sizes=[64, 32], sharding_type="table_wise", output_dir="")
    run = build_training(cfg, env)
    tables = plan_tables(run.plan)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    for url in urls:
        cfg.checkpoint_dir = url
        store, _ = open_checkpoints(cfg, env)
        progress = {"step": 1, "train_loss": 0.0}
        save_s = timed(lambda: save(store, run.model, run.optimizer, progress, tables, cfg, env))
        checkpoint = store.newest() if env.is_main else None
        box = [checkpoint]
        dist.broadcast_object_list(box)
        load_s = timed(lambda: restore(store, box[0], run.model, run.optimizer, tables, cfg, env))
        fs, root = fsspec.core.url_to_fs(store.step_url(1))
        mine = sum(fs.size(f) for f in fs.ls(root, detail=False) if f.endswith(f"__{env.rank}_0.distcp"))
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total)
        payload = os.urandom(1024 * 1024) * (mine // (1024 * 1024) + 1)
        payload = payload[:mine]
        raw = f"{url}/raw/rank{env.rank}.bin"

        def raw_write() -> None:
            with fsspec.open(raw, "wb") as f:
                f.write(payload)

        def raw_read() -> None:
            with fsspec.open(raw, "rb") as f:
                f.read()

        write_s, read_s = timed(raw_write), timed(raw_read)
        if env.is_main:
            gb = total.item() / 1e9
            print(f"{url.split(':')[0] if '://' in url else 'local'}: {gb:.2f} GB of shards | "
                  f"save {gb / save_s:.3f} GB/s vs raw write {gb / write_s:.3f} GB/s = {write_s / save_s:.2f} | "
                  f"load {gb / load_s:.3f} GB/s vs raw read {gb / read_s:.3f} GB/s = {read_s / load_s:.2f}",
                  flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each of the 8 tables")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker is not None:
        worker(opts.worker, opts.rows)
        return

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-west-2", "AWS_EC2_METADATA_DISABLED": "true",
           "OMP_NUM_THREADS": "1"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-west-2",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(
        Bucket="bench", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as local:
        urls = [os.path.join(local, "ckpt"), "s3://bench/ckpt"]
        print(f"tables: 8 x {opts.rows:,} x 32 float32 + row-wise Adagrad state, {opts.nproc} ranks", flush=True)
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(opts.nproc),
             os.path.abspath(__file__), "--rows", str(opts.rows), "--worker", *urls],
            env=env, check=True,
        )
    server.stop()


if __name__ == "__main__":
    main()
