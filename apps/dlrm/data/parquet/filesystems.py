"""pyarrow's own filesystem for the files an fsspec filesystem lists, for reading row groups.

Users name data by fsspec URLs (``s3://bucket/clicks/``, a local path, ``gs://...``) and give
credentials as fsspec and the cloud SDKs take them; the footers are read and the files listed
through fsspec (:mod:`apps.dlrm.data.parquet.files`). Row groups, the bulk of the bytes, are read
through pyarrow's filesystems where it has its own: its C++ S3 client costs a fraction of the CPU
time of s3fs's Python one per byte (benchmarks/parquet_loader.py), and its local files are read
without Python in between. Any other filesystem is read through fsspec inside pyarrow
(``PyFileSystem(FSSpecHandler(fs))``), as before.
"""

from urllib.parse import urlparse

import fsspec
import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem

_AWS_DOMAIN = ".amazonaws.com"


def arrow_filesystem(fs: fsspec.AbstractFileSystem, path: str) -> pafs.FileSystem:
    """A pyarrow filesystem that reads the paths of ``fs`` (such as ``path``, one of its files)
    with the same endpoint and credentials."""
    if isinstance(fs, LocalFileSystem):
        return pafs.LocalFileSystem()
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    if "s3" in protocols:
        return _s3(fs, path.split("/", 1)[0])
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _s3(fs: fsspec.AbstractFileSystem, bucket: str) -> pafs.S3FileSystem:
    """pyarrow's S3 client for what s3fs's ``fs`` reaches: the endpoint and region its client
    resolved (from its options, ``AWS_ENDPOINT_URL``, ``AWS_REGION``, the AWS config files), and
    the credentials given to it; none given, both clients look them up alike (the ``AWS_*``
    variables, the shared credentials file and profile, the instance's role). On AWS itself the
    bucket's region is asked for, as s3fs follows the bucket's redirect."""
    endpoint = urlparse(fs.s3.meta.endpoint_url)
    on_aws = (endpoint.hostname or "").endswith(_AWS_DOMAIN)
    return pafs.S3FileSystem(
        access_key=fs.key,
        secret_key=fs.secret,
        session_token=fs.token,
        anonymous=bool(fs.anon),
        region=pafs.resolve_s3_region(bucket) if on_aws else fs.s3.meta.region_name,
        endpoint_override=None if on_aws else endpoint.netloc,
        scheme=endpoint.scheme or "https",
    )
