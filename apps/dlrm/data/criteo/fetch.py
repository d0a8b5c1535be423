"""Making a preprocessed folder local, so that it can be memory-mapped.

A local ``--data_path`` is used in place. A URL (``s3://``, ``gs://``, ...) is copied once per
node into a cache folder: the first local rank copies, the other local ranks of the node wait
until every file is in place and checked.

The cache holds files that every rank then trusts and memory-maps, so:

- it is private: ``--data_cache_dir``, or by default ``<tmp>/torchrec-dlrm-<uid>/criteo/<hash
  of the URL>``, must be a real folder (not a symbolic link) of this user that no one else can
  write into; it is created with mode 0700;
- every file is checked against the size and SHA-256 that the preprocessing recorded in the
  folder's ``manifest.json``: a copy that does not match is refused, and a file already in the
  cache is reused only if it matches. A file is hashed once: a *stamp* then records its
  checksum with its size, mtime and ctime, and holds only while those are unchanged (a stamp
  lives in ``<tmp>/torchrec-dlrm-<uid>/verified/``, named after the file's device and inode, so
  that the cache folder holds exactly the files of the remote folder);
- the manifest's day names are checked (``layout.parse_manifest``) before they become paths.

The manifest is read from the URL by every rank and written into the cache last, once every
file is in place: a restart after an interrupted copy checks (and copies) again what is missing.
"""

import contextlib
import hashlib
import io
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass

import fsspec
from tqdm import tqdm

from apps.core.common.errors import ConfigError
from apps.core.urls import is_url, reaching
from apps.dlrm.data.criteo.layout import (
    MANIFEST,
    day_files,
    file_digest,
    parse_manifest,
    require_npy_days,
    temporary_name,
    write_json,
)

logger = logging.getLogger("apps.dlrm.data")

_POLL_SECONDS = 1.0
_COPY_CHUNK = 16 << 20


def private_folder(path: str, what: str, fix: str) -> str:
    """``path``, created with mode 0700 if missing, checked to be a real folder (not a
    symbolic link) owned by this user and writable by no one else: whoever can write into it
    could swap the files that training memory-maps. Else a ConfigError naming ``what``
    ``path`` and ending with ``fix``."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with contextlib.suppress(FileExistsError):  # there before, or made by another rank
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be created ({e.strerror}): {fix}") from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to user id {st.st_uid}, not to this user ({os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o}; `chmod go-w` it)"
    else:
        return path
    raise ConfigError(f"{what} {path} {problem}; only a private folder of this user is safe: {fix}")


def _user_folder(name: str) -> str:
    """Folder ``name`` of this user's private folder in the temporary folder (node-local, unlike
    a home folder that is often shared between nodes), created and checked."""
    fix = "remove it, set TMPDIR to a folder of yours, or give --data_cache_dir"
    user = private_folder(os.path.join(tempfile.gettempdir(), f"torchrec-dlrm-{os.geteuid()}"), "the folder", fix)
    return private_folder(os.path.join(user, name), "the folder", fix)


def local_folder(data_path: str, cache_dir: str, copier: bool) -> str:
    """The local folder of ``data_path``; for a URL, the cache it is copied to.

    ``copier``: this process copies (the first local rank); the others wait for its files.
    """
    if not is_url(data_path):
        folder = data_path.removeprefix("file://")
        if not os.path.isdir(folder):
            raise ConfigError(f"--data_path {data_path} is not a folder")
        return folder
    if cache_dir:
        folder = private_folder(cache_dir, "--data_cache_dir", "give another folder")
    else:
        digest = hashlib.sha256(data_path.rstrip("/").encode()).hexdigest()[:16]
        folder = private_folder(
            os.path.join(_user_folder("criteo"), digest),
            "the Criteo cache folder",
            "remove it, or give --data_cache_dir",
        )
    cache = _Cache(folder, stamps=_user_folder("verified"))
    fs, root = fsspec.core.url_to_fs(data_path)
    remote = _Remote(fs, root.rstrip("/"), data_path)
    with reaching("--data_path", data_path):
        text, expected = remote.manifest()
        if copier:
            cache.fill(remote, expected)
            cache.write(MANIFEST, text)  # last: the cache is complete
        else:
            while not (cache.holds(MANIFEST, text) and all(cache.stamped(n, d) for n, d in expected.items())):
                time.sleep(_POLL_SECONDS)
    return folder


@dataclass
class _Remote:
    fs: fsspec.AbstractFileSystem
    root: str
    url: str  # --data_path, for messages

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def manifest(self) -> tuple[bytes, dict[str, dict]]:
        """The manifest's bytes, and the size and SHA-256 of every file to copy."""
        try:
            text = self.fs.cat_file(self.path(MANIFEST))
        except FileNotFoundError:
            raise ConfigError(
                f"--data_path {self.url} has no {MANIFEST}: give the URL of a folder written by "
                "`python -m apps.dlrm.preprocess --output` (and copied there)"
            ) from None
        fix = (
            "rerun `python -m apps.dlrm.preprocess` with the same options on the folder it was "
            "copied from (that records the checksums of its complete days), and copy it again"
        )
        manifest = parse_manifest(text, f"{self.url}/{MANIFEST}", fix)
        require_npy_days(manifest, self.url)
        expected = {}
        for day in manifest["days"]:
            for name in day_files(day):
                if name not in manifest.get("files", {}):
                    raise ConfigError(
                        f"{self.url}/{MANIFEST} records no checksum of {name} (day {day} is "
                        f"incomplete, or was written before checksums were recorded): {fix}"
                    )
                entry = manifest["files"][name]
                expected[name] = {"size": entry["size"], "sha256": entry["sha256"]}
        return text, expected


@dataclass
class _Cache:
    """The cache folder, and the stamps of the files in it that were hashed and matched.

    A stamp is named after the file's device and inode and records its size, mtime and ctime
    when it was hashed: it holds only while the file has not changed (a write changes the
    mtime and ctime, no one can set a ctime, and a file put there gets another inode or ctime).
    """

    folder: str
    stamps: str

    def fill(self, remote: _Remote, expected: dict[str, dict]) -> None:
        """Makes every file of ``expected`` present and checked: reused if it matches (by its
        stamp, else hashed once), else copied."""
        todo = [n for n, d in expected.items() if not self.stamped(n, d) and not self._verify(n, d)]
        missing = [name for name in todo if not remote.fs.exists(remote.path(name))]
        if missing:
            raise ConfigError(
                f"--data_path {remote.url} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: "
                "copy the complete preprocessed folder there"
            )
        total = sum(expected[n]["size"] for n in todo)
        if todo:
            logger.info("copying %d files (%.1f GB) of %s to %s", len(todo), total / 1e9, remote.url, self.folder)
        with tqdm(total=total, unit="B", unit_scale=True, desc="copy", disable=not todo, mininterval=5.0) as bar:
            for name in todo:
                self._copy(remote, name, expected[name], bar)

    def _copy(self, remote: _Remote, name: str, expected: dict, bar: tqdm) -> None:
        """Copies ``name``, hashing it on the way; refuses a copy that does not match
        ``expected`` (then nothing is left of it)."""
        local = os.path.join(self.folder, name)
        tmp = temporary_name(local)
        sha256, size = hashlib.sha256(), 0
        try:
            with remote.fs.open(remote.path(name), "rb") as source, _create(tmp) as target:
                while chunk := source.read(_COPY_CHUNK):
                    target.write(chunk)
                    sha256.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
            if {"size": size, "sha256": sha256.hexdigest()} != expected:
                raise ConfigError(
                    f"the copy of {name} from --data_path {remote.url} has {size} bytes and SHA-256 "
                    f"{sha256.hexdigest()}, but its {MANIFEST} records {expected['size']} bytes and "
                    f"{expected['sha256']}: the folder there is damaged or was changed while copied; "
                    "copy the preprocessed folder there again"
                )
            os.replace(tmp, local)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)
        self._stamp(name, expected)

    def write(self, name: str, data: bytes) -> None:
        path = os.path.join(self.folder, name)
        tmp = temporary_name(path)
        with _create(tmp) as f:
            f.write(data)
        os.replace(tmp, path)

    def holds(self, name: str, data: bytes) -> bool:
        try:
            with open(os.path.join(self.folder, name), "rb") as f:
                return f.read() == data
        except FileNotFoundError:
            return False

    def _identity(self, name: str) -> dict | None:
        """What a stamp of file ``name`` records besides the checksum; None: no regular file."""
        try:
            st = os.lstat(os.path.join(self.folder, name))
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return {
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
            "dev": st.st_dev,
            "ino": st.st_ino,
        }

    def _stamp_path(self, identity: dict) -> str:
        return os.path.join(self.stamps, f"{identity['dev']}-{identity['ino']}.json")

    def stamped(self, name: str, expected: dict) -> bool:
        """Whether file ``name`` was hashed, matched ``expected`` and has not changed since."""
        identity = self._identity(name)
        if identity is None or identity["size"] != expected["size"]:
            return False
        try:
            with open(self._stamp_path(identity)) as f:
                return json.load(f) == {**identity, "sha256": expected["sha256"]}
        except (FileNotFoundError, ValueError):
            return False

    def _stamp(self, name: str, expected: dict) -> None:
        identity = self._identity(name)
        assert identity is not None, f"{name} was just copied or checked, as a regular file"
        write_json(self._stamp_path(identity), {**identity, "sha256": expected["sha256"]})

    def _verify(self, name: str, expected: dict) -> bool:
        """Hashes file ``name`` if it has the expected size (a file left by an earlier run whose
        stamp is gone); stamps it if it matches."""
        identity = self._identity(name)
        if identity is None or identity["size"] != expected["size"]:
            return False
        if file_digest(os.path.join(self.folder, name)) != expected or self._identity(name) != identity:
            return False
        self._stamp(name, expected)
        return True


def _create(path: str) -> io.BufferedWriter:
    """``path`` (a fresh temporary name) opened for writing as a new file: never through a link."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")
