"""An S3-compatible server (moto) on loopback for the benchmarks that compare local disk and S3.

moto and boto3 are imported only when a bucket is made, so ``--targets local`` runs without them.
"""

import argparse
import contextlib
import logging
import sys
from typing import Iterator

TARGETS = ("local", "s3")


@contextlib.contextmanager
def s3_bucket(bucket: str) -> Iterator[dict[str, str]]:
    """An S3 server (moto) on loopback with an empty ``bucket``: yields the AWS variables for it."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        sys.exit(
            f"--targets s3 needs moto's server and boto3 ({e}): "
            "pip install 'moto[server]' boto3, or measure --targets local only"
        )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-west-2",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region_name="us-west-2",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        ).create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        yield env
    finally:
        server.stop()


def targets_arg(value: str) -> tuple[str, ...]:
    """--targets: a comma-separated subset of TARGETS, measured in TARGETS' order."""
    chosen = set(value.split(","))
    unknown = sorted(chosen - set(TARGETS))
    if unknown or not value:
        raise argparse.ArgumentTypeError(
            f"{value!r}: {', '.join(unknown) or 'nothing'} is not a target; give local, s3 or local,s3"
        )
    return tuple(t for t in TARGETS if t in chosen)


def add_targets_argument(parser: argparse.ArgumentParser) -> None:
    """--targets: where a benchmark checkpoints (default: local,s3)."""
    parser.add_argument(
        "--targets",
        type=targets_arg,
        default=TARGETS,
        help="where to checkpoint, comma-separated: local (a temporary folder under "
        "$BENCH_DIR, default /var/tmp), s3 (moto on loopback). Default: local,s3",
    )
