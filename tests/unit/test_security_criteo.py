"""Hostile and sloppy input to the Criteo data path: the download cache, remote manifests,
binary garbage in click logs, and --output folders that are not ours."""

import json
import logging
import os
import re
import tempfile
import threading

import fsspec
import numpy as np
import pytest

from apps.core.common.errors import ConfigError
from apps.dlrm.data.criteo import fetch
from apps.dlrm.data.criteo.config import PreprocessConfig
from apps.dlrm.data.criteo.fetch import local_folder
from apps.dlrm.data.criteo.layout import MANIFEST, day_files, day_report_file, open_folder, write_json
from apps.dlrm.data.criteo.pipeline import preprocess
from testing.criteo_files import generate_day, write_day
from tests.unit.test_criteo_data import write_folder

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

URL = "memory://criteo"


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """The temporary folder (default cache, stamps) is this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)


@pytest.fixture
def remote(tmp_path):
    """A preprocessed folder, and its copy at URL."""
    folder = write_folder(tmp_path / "npy", [300, 200])
    memory = fsspec.filesystem("memory")
    if memory.exists("/criteo"):  # left by another test
        memory.rm("/criteo", recursive=True)
    for name in os.listdir(folder):
        memory.put(os.path.join(folder, name), f"/criteo/{name}")
    yield folder, memory
    memory.rm("/criteo", recursive=True)


def set_manifest(memory, change) -> None:
    manifest = json.loads(memory.cat_file("/criteo/manifest.json"))
    change(manifest)
    memory.pipe_file("/criteo/manifest.json", json.dumps(manifest).encode())


def same_size_other_bytes(path) -> None:
    """Flips a byte of ``path``, keeping its size and mtime: what a size check cannot see."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("day", ["../escaped", "sub/day", ".hidden", "day\x00", "\x1b[31mday"])
def test_a_day_that_is_not_a_plain_file_name_is_refused_before_it_becomes_a_path(remote, tmp_path, day):
    folder, memory = remote
    set_manifest(memory, lambda m: m["days"].append(day))
    for name in day_files(day):  # "../escaped" would land in tmp_path, outside the cache
        memory.pipe_file(f"/criteo/{name}", b"planted")
    with pytest.raises(ConfigError, match="not a plain file name") as refused:
        local_folder(URL, str(tmp_path / "cache"), copier=True)
    assert "\x1b" not in str(refused.value) and "\x00" not in str(refused.value)
    assert not list(tmp_path.rglob("escaped*"))
    write_json(os.path.join(folder, MANIFEST), json.loads(memory.cat_file("/criteo/manifest.json")))
    with pytest.raises(ConfigError, match="not a plain file name"):  # the local reader, the same check
        open_folder(folder)


def test_the_default_cache_is_a_private_folder_of_the_user(remote):
    cache = local_folder(URL, "", copier=True)
    user = os.path.join(tempfile.gettempdir(), f"torchrec-dlrm-{os.geteuid()}")
    assert cache.startswith(user + os.sep)
    for path in (user, cache):
        st = os.lstat(path)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700, (path, oct(st.st_mode))


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda path, elsewhere: os.symlink(elsewhere, path), "is a symbolic link"),
        (lambda path, elsewhere: (os.mkdir(path), os.chmod(path, 0o777)), "can be written by other users"),
        (lambda path, elsewhere: (os.mkdir(path), os.chown(path, 65534, 65534)), "belongs to user id 65534"),
    ],
    ids=["symlink", "writable_by_others", "owned_by_another_user"],
)
def test_a_cache_folder_that_others_control_is_refused(remote, tmp_path, make, problem):
    if problem.startswith("belongs") and os.geteuid() != 0:
        pytest.skip("giving a folder away needs root")
    os.mkdir(tmp_path / "elsewhere")
    given = str(tmp_path / "cache")
    make(given, str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match=re.escape(f"--data_cache_dir {given} {problem}")):
        local_folder(URL, given, copier=True)
    default_user_folder = os.path.join(tempfile.gettempdir(), f"torchrec-dlrm-{os.geteuid()}")
    make(default_user_folder, str(tmp_path / "elsewhere"))  # squatted by someone else
    with pytest.raises(ConfigError, match=re.escape(f"{default_user_folder} {problem}") + ".*set TMPDIR"):
        local_folder(URL, "", copier=True)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_cached_file_is_reused_only_while_its_checksum_matches(remote, tmp_path):
    folder, _ = remote
    cache = local_folder(URL, str(tmp_path / "cache"), copier=True)
    damaged = os.path.join(cache, "day_0_sparse.npy")
    same_size_other_bytes(damaged)
    assert local_folder(URL, cache, copier=True) == cache
    with open(damaged, "rb") as a, open(os.path.join(folder, "day_0_sparse.npy"), "rb") as b:
        assert a.read() == b.read()  # copied again
    planted = str(tmp_path / "fresh")  # a folder someone filled before the first run
    os.mkdir(planted, 0o700)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as src, open(os.path.join(planted, name), "wb") as dst:
            dst.write(src.read())
    same_size_other_bytes(os.path.join(planted, "day_1_dense.npy"))
    local_folder(URL, planted, copier=True)
    np.testing.assert_array_equal(
        np.load(os.path.join(planted, "day_1_dense.npy")), np.load(os.path.join(folder, "day_1_dense.npy"))
    )


def test_the_other_ranks_wait_until_every_cached_file_is_checked(remote, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_POLL_SECONDS", 0.05)
    cache = local_folder(URL, str(tmp_path / "cache"), copier=True)
    same_size_other_bytes(os.path.join(cache, "day_1_labels.npy"))
    waiter = threading.Thread(target=local_folder, args=(URL, cache, False), daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # a file of the right size is not enough
    local_folder(URL, cache, copier=True)
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_a_copy_that_does_not_match_its_checksum_is_refused(remote, tmp_path):
    _, memory = remote
    data = bytearray(memory.cat_file("/criteo/day_1_sparse.npy"))
    data[-1] ^= 0xFF  # changed after it was preprocessed
    memory.pipe_file("/criteo/day_1_sparse.npy", bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="copy of day_1_sparse.npy .* has .* SHA-256 .* records"):
        local_folder(URL, str(cache), copier=True)
    assert not [name for name in os.listdir(cache) if "day_1_sparse" in name]


def test_a_folder_without_checksums_is_refused_until_preprocessing_adds_them(tmp_path):
    write_day(generate_day(300, seed=1, malformed=False), tmp_path / "day_0")
    output = tmp_path / "npy"
    cfg = PreprocessConfig(input=[str(tmp_path / "day_0")], output=str(output), num_embeddings=100, workers=1)
    preprocess(cfg)
    for name in (MANIFEST, day_report_file("day_0")):  # as written before checksums were recorded
        value = json.loads((output / name).read_text())
        del value["files"]
        write_json(str(output / name), value)
    memory = fsspec.filesystem("memory")
    for name in os.listdir(output):
        memory.put(str(output / name), f"/criteo/{name}")
    with pytest.raises(ConfigError, match="records no checksum of day_0_dense.npy .* rerun `python -m apps"):
        local_folder(URL, str(tmp_path / "cache"), copier=True)
    preprocess(cfg)  # the fix the error names: the same options again
    memory.put(str(output / MANIFEST), f"/criteo/{MANIFEST}")
    memory.put(str(output / day_report_file("day_0")), f"/criteo/{day_report_file('day_0')}")
    assert local_folder(URL, str(tmp_path / "cache"), copier=True) == str(tmp_path / "cache")
    memory.rm("/criteo", recursive=True)


def test_binary_garbage_in_a_click_log_is_skipped_and_never_echoed(tmp_path, caplog):
    good = generate_day(50, seed=3, malformed=False)
    lines = [line.encode() for line in good.lines]
    binary_field = lines[0].split(b"\t")
    binary_field[1] = b"\xc3\x28"  # 40 fields, one not UTF-8
    lines[10:10] = [b"\x1b]0;pwned\x07\x1b[31m\xff\xfe\tgarbage", b"\t".join(binary_field)]
    (tmp_path / "day_0").write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.INFO):
        report = preprocess(
            PreprocessConfig(
                input=[str(tmp_path / "day_0")], output=str(tmp_path / "out"), num_embeddings=100, workers=1
            )
        )
    assert report["rows_written"] == good.rows_written
    assert report["skipped"]["undecodable"] == 2 and report["rows_read"] == good.rows_written + 2
    assert "undecodable 2" in caplog.text and "\x1b" not in caplog.text and "\ufffd" not in caplog.text


def test_a_click_log_whose_name_cannot_be_a_day_is_refused(tmp_path):
    (tmp_path / "\x1b[31mday").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"would become day '\\x1b\[31mday'.*rename it"):
        preprocess(PreprocessConfig(input=[str(tmp_path / "*day")], output=str(tmp_path / "out")))


@pytest.mark.parametrize(
    "name, content",
    [
        ("report.json", '{"theirs": true}'),  # the report of another tool
        ("notes.txt", "keep me"),
        (MANIFEST, '{"format": "another-tool"}'),
        (MANIFEST, "not json"),
    ],
)
def test_an_output_folder_that_is_not_ours_is_refused_before_anything_is_written(tmp_path, name, content):
    write_day(generate_day(20, seed=2, malformed=False), tmp_path / "day_0")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / name).write_text(content)
    with pytest.raises(
        ConfigError, match=re.escape(f"--output {foreign} is not empty") + "|" + re.escape(f"{foreign}/{MANIFEST}")
    ) as refused:
        preprocess(PreprocessConfig(input=[str(tmp_path / "day_0")], output=str(foreign), workers=1))
    assert "another --output" in str(refused.value) or "empty or new folder" in str(refused.value)
    assert os.listdir(foreign) == [name] and (foreign / name).read_text() == content


def test_temporary_names_cannot_be_guessed_in_advance(tmp_path):
    """A predictable name (it was the process id) lets someone plant a link there to write through."""
    from apps.dlrm.data.criteo.layout import temporary_name

    names = {temporary_name(str(tmp_path / "day_0_dense.npy")) for _ in range(3)}
    assert len(names) == 3 and all(os.path.dirname(n) == str(tmp_path) for n in names)
