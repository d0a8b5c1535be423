"""Checkpoint storage: tensors are read straight into the tensors they load into, exactly, from
checkpoints in DCP's own format (what the app wrote before, too), and nothing in an entry runs code."""

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from apps.core.checkpoint.storage import batched_reader
from apps.core.checkpoint.storage.loading import load_shards
from apps.core.checkpoint.storage.saving import save_shards
from apps.core.checkpoint.storage.writer import CheckpointWriter
from apps.core.common.distributed import free_port
from tests.shards import sharded, whole

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

# local=True reads the files in place, local=False fetches byte ranges as on object stores.
READERS = pytest.mark.parametrize("local", [True, False], ids=["in place", "batched"])


@pytest.fixture(scope="module")
def world_of_one():
    """This process as a world of one rank: sharded tensors need a process group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def varied() -> dict:
    """Entries of every kind: dtypes, a 0-dim tensor, a tensor stored transposed, a view of a
    larger tensor, a float8 tensor (pickled another way: torch.load reads it), plain data."""
    torch.manual_seed(0)
    return {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(4, 3).bfloat16(),
        "i64": torch.arange(9),
        "bool": torch.rand(10) > 0.5,
        "scalar": torch.tensor(3.5),
        "transposed": torch.randn(6, 4).t(),
        "view": torch.randn(100)[10:20],
        "f8": torch.randn(3, 3).to(torch.float8_e4m3fn),
        "plain": {"lr": 0.5, "betas": [0.9, 0.99]},
    }


def blank(state: dict) -> dict:
    """Fresh targets for ``state``: zeros, contiguous, and other plain data."""
    return {
        name: torch.zeros(value.shape, dtype=value.dtype)
        if isinstance(value, torch.Tensor)
        else {"lr": 0.0, "betas": [0.0, 0.0]}
        for name, value in state.items()
    }


def assert_equal(loaded: dict, saved: dict) -> None:
    for name, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), name
        else:
            assert loaded[name] == value, name


@READERS
@pytest.mark.parametrize(
    "writer",
    [
        lambda url: CheckpointWriter(url, sync_files=False),  # the app's saves before CheckpointSavePlanner
        lambda url: FsspecWriter(url),  # DCP's own
    ],
    ids=["app's previous save", "DCP's writer"],
)
def test_checkpoints_in_dcps_format_load_exactly(tmp_path, local, writer):
    saved = varied()
    dcp.save(saved, storage_writer=writer(str(tmp_path)), no_dist=True)
    loaded = blank(saved)
    load_shards(loaded, str(tmp_path), local, checksums=None)
    assert_equal(loaded, saved)


def test_object_store_reads_in_many_fetches_load_exactly(tmp_path, monkeypatch):
    # Fetches of at most 64 bytes: about one per entry, each fetched while the last one loads.
    monkeypatch.setattr(batched_reader, "_READ_BATCH_BYTES", 64)
    saved = varied()
    dcp.save(saved, storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    loaded = blank(saved)
    load_shards(loaded, str(tmp_path), local=False, checksums=None)
    assert_equal(loaded, saved)


@READERS
def test_plain_tensors_are_read_into_their_targets_without_torch_load(tmp_path, local, monkeypatch):
    saved = {name: value for name, value in varied().items() if name not in ("f8", "plain")}
    dcp.save(saved, storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    loaded = blank(saved)
    addresses = {name: tensor.data_ptr() for name, tensor in loaded.items()}

    def refuse(*args, **kwargs):
        raise AssertionError("a plain tensor went through torch.load")

    monkeypatch.setattr(torch, "load", refuse)
    load_shards(loaded, str(tmp_path), local, checksums=None)
    assert_equal(loaded, saved)
    assert {name: tensor.data_ptr() for name, tensor in loaded.items()} == addresses


ROWS = [(0, 3, 0, 4), (3, 6, 0, 4)]
COLUMNS = [(0, 6, 0, 1), (0, 6, 1, 4)]
WHOLE = [(0, 6, 0, 4)]
UNEVEN_ROWS = [(0, 2, 0, 4), (2, 6, 0, 4)]


@READERS
@pytest.mark.parametrize(
    "before, after",
    [(ROWS, UNEVEN_ROWS), (ROWS, COLUMNS), (COLUMNS, WHOLE), (COLUMNS, ROWS)],
    ids=["rows to rows", "rows to columns", "columns to whole", "columns to rows"],
)
def test_resharded_pieces_load_exactly(tmp_path, world_of_one, local, before, after):
    """Pieces that are one run of a stored tensor's bytes (rows), pieces strewn through it
    (columns), and targets that are not contiguous (a whole tensor's columns)."""
    full = torch.randn(6, 4)
    dcp.save({"w": sharded(full, before)}, storage_writer=FsspecWriter(str(tmp_path)))
    target = sharded(torch.zeros(6, 4), after)
    load_shards({"w": target}, str(tmp_path), local, checksums=None)
    assert torch.equal(whole(target), full)


def test_the_entries_that_are_not_shards_are_in_a_file_of_their_own(tmp_path, world_of_one):
    """What another rank reads of this rank's files (replicated entries) is then a small file, none of its shards."""
    state = {
        "a_table": sharded(torch.randn(6, 4), ROWS),
        "dense": torch.randn(3),
        "z_table": sharded(torch.randn(6, 4), ROWS),
        "progress": torch.tensor([1.0, 0.5]),
    }
    save_shards(state, str(tmp_path), local=True)
    storage = FsspecReader(str(tmp_path)).read_metadata().storage_data
    files = {index.fqn: info.relative_path for index, info in storage.items()}
    assert files == {
        "a_table": "__0_0.distcp",
        "z_table": "__0_0.distcp",
        "dense": "__0_1.distcp",
        "progress": "__0_1.distcp",
    }
    loaded = {"a_table": sharded(torch.zeros(6, 4), ROWS), "dense": torch.zeros(3), "progress": torch.zeros(2)}
    loaded["z_table"] = sharded(torch.zeros(6, 4), ROWS)
    load_shards(loaded, str(tmp_path), local=True, checksums=None)
    assert torch.equal(loaded["dense"], state["dense"])
    assert torch.equal(whole(loaded["z_table"]), whole(state["z_table"]))


class RunsCode:
    """Unpickles as ``touch MARKER``: what an attacker would plant."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@READERS
def test_a_planted_tensor_entry_is_refused_and_runs_nothing(tmp_path, local):
    """A tensor entry replaced by a torch.save of an object that runs code, with a .metadata
    pointing at it: refused unloaded, by the layout reader and by torch.load(weights_only=True)."""
    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    dcp.save({"x": torch.zeros(4)}, storage_writer=FsspecWriter(str(folder)), no_dist=True)
    metadata = FsspecReader(str(folder)).read_metadata()
    ((index, info),) = metadata.storage_data.items()
    with open(folder / info.relative_path, "wb") as f:
        torch.save(RunsCode(marker), f)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, 0, (folder / info.relative_path).stat().st_size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException, match="entry x holds a pickled object, not plain data"):
        load_shards({"x": torch.zeros(4)}, str(folder), local, checksums=None)
    assert not marker.exists()
