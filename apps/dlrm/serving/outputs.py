"""Where export and prediction write: never over anything, each file whole or not at all."""

import os
import posixpath
import uuid
from typing import IO, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls


class OutputError(ConfigError):
    """An output place cannot be written; the message names it and says what to do."""


def refuse_existing(url: str, option: str = "--output") -> None:
    """Refuses a place that holds anything (a package, predictions, other files): what a job
    writes there would overwrite it, or be mixed with it."""
    fs, root = fsspec.core.url_to_fs(url)
    held = fs.ls(root, detail=False) if fs.isdir(root) else [root] if fs.exists(root) else []
    if held:
        names = sorted(posixpath.basename(path.rstrip("/")) for path in held)
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise OutputError(
            f"{option} {redact_urls(url)} already holds {len(names)} entries ({listed}), which would be "
            f"overwritten: give a new {option}, or delete it first"
        )


def write_file(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[IO[bytes]], object]) -> None:
    """Writes the file ``path`` with ``write`` so that no reader sees part of it: a local file
    under a temporary name (starting with '.', which readers of folders leave out) renamed into
    place; an object store's upload appears whole when it completes."""
    if not isinstance(fs, LocalFileSystem):
        with fs.open(path, "wb") as f:
            write(f)
        return
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
