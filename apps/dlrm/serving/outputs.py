"""Where export and prediction write: never over anything, each file whole or not at all, and a
prediction's ``--output`` by one job at a time."""

import contextlib
import os
import posixpath
import uuid
from typing import IO, Any, Callable, Iterator, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls

#: In an ``--output`` that a job writes, the job's id: a second job is refused; removed once the
#: job is done (its report written), when the place's whole contents are its results.
JOB_FILE = ".JOB"


class OutputError(ConfigError):
    """An output place cannot be written; the message names it and says what to do."""


def refuse_existing(url: str, option: str = "--output", claims: bool = False) -> None:
    """Refuses a place that holds anything (a package, predictions, other files): what a job
    writes there would overwrite it, or be mixed with it. ``claims``: a job's file that claims
    the place (:func:`claim`), or is being linked into place, is left to :func:`claim` to judge."""
    fs, root = fsspec.core.url_to_fs(url)
    held = fs.ls(root, detail=False) if fs.isdir(root) else [root] if fs.exists(root) else []
    names = sorted(posixpath.basename(path.rstrip("/")) for path in held)
    if claims:
        names = [name for name in names if not name.startswith(JOB_FILE)]
    if names:
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise OutputError(
            f"{option} {redact_urls(url)} already holds {len(names)} entries ({listed}), which would be "
            f"overwritten: give a new {option}, or delete it first"
        )


def claim(url: str, job: str, option: str = "--output") -> bool:
    """Makes the place ``url`` job ``job``'s to write (its :data:`JOB_FILE`), or refuses it in one
    line: a place that holds anything (:func:`refuse_existing`), the file of another job (live,
    or one that stopped before it was done) first among it. Of jobs claiming one place at once,
    one gets it: on a local disk the file is linked into place, which only one can do; an object
    store has no such step, so there the file is read back after it is written, which leaves
    only jobs started within the same moment to the store's last writer. Returns whether the
    place was made (it did not exist)."""
    fs, root = fsspec.core.url_to_fs(url)
    marker = posixpath.join(root, JOB_FILE)
    with _writing(url):
        _refuse_owned(fs, marker, url, option)
        refuse_existing(url, option, claims=True)
        made = not fs.exists(root)
        fs.makedirs(root, exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            tmp = f"{marker}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "x") as f:
                f.write(job)
            try:
                os.link(tmp, marker)  # fails where another job's is already in place
            except FileExistsError:
                pass
            finally:
                os.remove(tmp)
        else:
            fs.pipe_file(marker, job.encode())
        if _owner(fs, marker) != job:
            _refuse_owned(fs, marker, url, option)
    return made


def release(url: str) -> None:
    """The job that claimed ``url`` is done: its results are what the place holds."""
    fs, root = fsspec.core.url_to_fs(url)
    with _writing(url):
        fs.rm_file(posixpath.join(root, JOB_FILE))


def withdraw(url: str, made: bool) -> None:
    """The job that claimed ``url`` (and ``made`` it) stops before writing anything: the place is
    left as it was, its claim removed (and, on a local disk, the folder it made)."""
    release(url)
    fs, root = fsspec.core.url_to_fs(url)
    if made and isinstance(fs, LocalFileSystem):
        with contextlib.suppress(OSError):  # not empty after all: someone else's files, kept
            os.rmdir(root)


def _owner(fs: fsspec.AbstractFileSystem, marker: str) -> str | None:
    try:
        return fs.cat_file(marker).decode()
    except FileNotFoundError:
        return None


def _refuse_owned(fs: fsspec.AbstractFileSystem, marker: str, url: str, option: str) -> None:
    owner = _owner(fs, marker)
    if owner is not None:
        raise OutputError(
            f"{option} {redact_urls(url)} is the output of job {owner} (its {JOB_FILE} file), which is writing it "
            f"or stopped before it was done: two jobs never write one {option}; give a new {option}, or delete "
            "that one if its job is over"
        )


def write_file(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[IO[bytes]], object]) -> None:
    """Writes the file ``path`` with ``write`` so that no reader sees part of it: under a
    temporary name (starting with '.', which readers of folders leave out) renamed into place
    (on an object store, copied), the temporary removed whatever happens. A place that cannot
    be written (disk full, read-only, no permission) is an :class:`OutputError` naming ``path``;
    a failure of ``write``'s own (reading what it writes) passes as it is."""
    folder, name = posixpath.split(path)
    tmp = posixpath.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
    local = isinstance(fs, LocalFileSystem)
    shown = path if local else fs.unstrip_protocol(path)
    try:
        with _writing(shown):
            fs.makedirs(folder, exist_ok=True)
            f = open(tmp, "wb") if local else fs.open(tmp, "wb")
        try:
            write(cast(IO[bytes], _Checked(f)))  # a file, as what writes to it sees it
        except BaseException:
            with contextlib.suppress(OSError):
                f.close()  # an object store's upload of the part written: removed below
            raise
        with _writing(shown):
            if local:
                f.flush()
                os.fsync(f.fileno())
            f.close()
            if local:
                os.replace(tmp, path)
            else:
                fs.mv(tmp, path)
    except _WriteFailed as e:
        raise _cannot_write(shown, e.error) from e.error
    finally:
        with contextlib.suppress(OSError):
            if fs.exists(tmp):
                fs.rm_file(tmp)


class _WriteFailed(Exception):
    """An OSError of writing the output, told apart from the OSErrors of what a writer reads."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Checked:
    """A file being written whose failures to write are :class:`_WriteFailed`."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            raise _WriteFailed(e) from e

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            raise _WriteFailed(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """OSErrors of writing ``path`` (or of the place it is in) as :class:`OutputError`."""
    try:
        yield
    except OSError as e:
        raise _cannot_write(path, e) from e


def _cannot_write(path: str, error: OSError) -> OutputError:
    why = error.strerror or str(error) or type(error).__name__
    return OutputError(
        f"cannot write {redact_urls(path)} ({why}): nothing half-written is kept; make room there or make it "
        "writable (or give another place), then run the job again into a new or emptied place"
    )
