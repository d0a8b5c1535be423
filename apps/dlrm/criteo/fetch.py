"""Making a preprocessed folder local, so that it can be memory-mapped.

A local ``--data_path`` is used in place. A URL (``s3://``, ``gs://``, ...) is copied once per
node into a cache folder: the first local rank copies, the other local ranks of the node wait for
each file to appear under its final name (files are copied under a temporary name and renamed).
A file already in the cache with the size of the remote one is not copied again, so restarts and
later runs start at once.
"""

import hashlib
import logging
import os
import tempfile
import time

import fsspec
from tqdm import tqdm

from apps.dlrm.criteo.layout import MANIFEST, day_files, read_json, temporary_name
from apps.dlrm.options import ConfigError

logger = logging.getLogger("apps.dlrm.data")

_POLL_SECONDS = 1.0
_COPY_CHUNK = 16 << 20


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def default_cache_dir(url: str) -> str:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "dlrm-criteo", digest)


def local_folder(data_path: str, cache_dir: str, copier: bool) -> str:
    """The local folder of ``data_path``; for a URL, the cache it is copied to.

    ``copier``: this process copies (the first local rank); the others wait for its files.
    """
    if not is_url(data_path):
        folder = data_path.removeprefix("file://")
        if not os.path.isdir(folder):
            raise ConfigError(f"--data_path {data_path} is not a folder")
        return folder
    fs, root = fsspec.core.url_to_fs(data_path)
    cache = cache_dir or default_cache_dir(data_path)
    os.makedirs(cache, exist_ok=True)
    manifest_path = f"{root.rstrip('/')}/{MANIFEST}"
    if not fs.exists(manifest_path):
        raise ConfigError(
            f"--data_path {data_path} has no {MANIFEST}: give the URL of a folder written by "
            "`python -m apps.dlrm.preprocess --output` (and copied there)"
        )
    _sync(fs, manifest_path, os.path.join(cache, MANIFEST), copier, always=True)
    names = [name for day in read_json(os.path.join(cache, MANIFEST))["days"] for name in day_files(day)]
    remote = {name: f"{root.rstrip('/')}/{name}" for name in names}
    missing = [name for name in names if not fs.exists(remote[name])]
    if missing:
        raise ConfigError(
            f"--data_path {data_path} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: "
            "copy the complete preprocessed folder there"
        )
    sizes = {name: fs.info(remote[name])["size"] for name in names}
    todo = [n for n in names if not _same_size(os.path.join(cache, n), sizes[n])]
    if todo:
        logger.info("copying %d files (%.1f GB) of %s to %s", len(todo),
                    sum(sizes[n] for n in todo) / 1e9, data_path, cache)
    with tqdm(total=sum(sizes[n] for n in todo), unit="B", unit_scale=True, desc="copy",
              disable=not (copier and todo), mininterval=5.0) as bar:
        for name in todo:
            _sync(fs, remote[name], os.path.join(cache, name), copier, size=sizes[name], bar=bar)
    return cache


def _same_size(path: str, size: int) -> bool:
    return os.path.exists(path) and os.path.getsize(path) == size


def _sync(fs, remote: str, local: str, copier: bool, size: int | None = None, always: bool = False, bar=None) -> None:
    """Copies ``remote`` to ``local`` (copier) or waits until the copier has (the others)."""
    if copier:
        if always or not _same_size(local, size):
            tmp = temporary_name(local)
            with fs.open(remote, "rb") as source, open(tmp, "wb") as target:
                while chunk := source.read(_COPY_CHUNK):
                    target.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            os.replace(tmp, local)
        return
    # The manifest is rewritten by every copier; its content does not change between runs.
    while not (os.path.exists(local) if size is None else _same_size(local, size)):
        time.sleep(_POLL_SECONDS)
