"""Finding the input click-log files (paths, folders, globs, fsspec URLs) and opening them.

Every input file becomes one *day* of the output, named after the file without its compression
and text extensions (``day_0.gz`` -> ``day_0``, ``train.txt`` -> ``train``). Days are ordered
naturally by name (``day_2`` before ``day_10``), which is the order of the Criteo 1TB days.
"""

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import fsspec
import pyarrow as pa

from apps.core.common.errors import ConfigError
from apps.core.urls import reaching
from apps.dlrm.data.criteo.layout import is_plain_name, shown

_GZIP_MAGIC = b"\x1f\x8b"
_EXTENSIONS = (".gz", ".tsv", ".txt", ".csv")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Source:
    url: str  # what fsspec opens (a local path or a URL)
    day: str
    size: int  # bytes as stored (compressed, for a gzip file)


def day_name(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    for extension in _EXTENSIONS:
        if name.endswith(extension) and len(name) > len(extension):
            name = name[: -len(extension)]
    return name


def natural_key(name: str) -> list:
    """``day_2`` sorts before ``day_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_sources(inputs: list[str], option: str = "--input") -> list[Source]:
    """The files that ``inputs`` name, as days in natural order; a bad input (or one whose day
    name could not be a file name of the output, see ``is_plain_name``) is a ConfigError naming
    ``option``, the option that gave them (preprocessing's --input, prediction's --data_path)."""
    sources: dict[str, Source] = {}
    for item in inputs:
        with reaching(option, item):
            found = _expand(item, option)
        for source in found:
            if not is_plain_name(source.day):
                raise ConfigError(
                    f"{option} file {shown(source.url)} would become day {shown(source.day)}, "
                    "which is not a plain file name (no leading '.', no control character): rename it"
                )
            other = sources.get(source.day)
            if other is not None and other.url != source.url:
                raise ConfigError(
                    f"{option} files {other.url} and {source.url} would both become day "
                    f"'{source.day}': rename one, or give them to separate runs (different --output folders)"
                )
            sources[source.day] = source
    return [sources[day] for day in sorted(sources, key=natural_key)]


def _expand(item: str, option: str) -> list[Source]:
    fs, path = fsspec.core.url_to_fs(item)
    if _GLOB_CHARS.search(path):
        entries = [fs.info(p) for p in fs.glob(path)]
        entries = [e for e in entries if e["type"] == "file"]
        if not entries:
            raise ConfigError(f"{option} {item} matches no file")
    elif not fs.exists(path):
        raise ConfigError(f"{option} {item} does not exist")
    elif fs.isdir(path):
        entries = [
            e
            for e in fs.ls(path, detail=True)
            if e["type"] == "file" and not os.path.basename(e["name"]).startswith(".")
        ]
        if not entries:
            raise ConfigError(f"{option} folder {item} holds no file")
    else:
        entries = [fs.info(path)]
    return [
        Source(
            url=fs.unstrip_protocol(e["name"]) if "://" in item else e["name"],
            day=day_name(e["name"]),
            size=int(e.get("size") or 0),
        )
        for e in entries
    ]


@contextlib.contextmanager
def open_lines(url: str) -> Iterator[tuple[pa.NativeFile, Callable[[], int]]]:
    """A byte stream of the lines of ``url`` (gunzipped if it is gzip), and a function that
    tells how many stored bytes have been read so far (for progress)."""
    fs, path = fsspec.core.url_to_fs(url)
    with contextlib.ExitStack() as stack:
        if "file" in fs.protocol:
            # Arrow's own file reader: its read-ahead thread then never waits for the GIL.
            raw = stack.enter_context(pa.OSFile(path))
        else:
            raw = pa.PythonFile(stack.enter_context(fs.open(path, "rb")), mode="r")
        magic = raw.read(len(_GZIP_MAGIC))
        raw.seek(0)
        stream = pa.CompressedInputStream(raw, "gzip") if magic == _GZIP_MAGIC else raw
        yield stream, raw.tell
