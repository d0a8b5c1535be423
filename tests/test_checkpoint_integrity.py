"""Damaged checkpoints (issue 24): a checkpoint whose files are not what it recorded, or whose
.metadata does not add up, is skipped with a warning, never resumed from, and never the reason
the last good one is deleted."""

import dataclasses
import pickle

import pytest
import torch
import torch.distributed as dist

from apps.dlrm.checkpoint.folder import CheckpointStore
from apps.dlrm.checkpoint.storage import CheckpointReader
from apps.dlrm.common.distributed import DistEnv, free_port
from tests.shards import sharded

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

TABLE = "table"


@pytest.fixture(scope="module")
def env():
    """This process as a world of one rank: sharded tensors and the store's decisions need a process group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def table_state(step: int) -> dict:
    """A checkpoint's state: a 6 x 4 table in two pieces of rows (as two ranks would hold it) and the step."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) + step
    return {TABLE: sharded(full, [(0, 3, 0, 4), (3, 6, 0, 4)]), "progress": torch.tensor([float(step)])}


def saved(root, env: DistEnv, steps=(10, 20), keep_last: int = 3) -> CheckpointStore:
    """A store under ``root`` holding the committed checkpoints of ``steps``."""
    store = CheckpointStore(str(root), keep_last=keep_last)
    store.run_id = "run"
    for step in steps:
        store.save(step, table_state(step), {"step": step}, env)
    return store


def rewrite_metadata(store: CheckpointStore, step: int, change) -> None:
    """Rewrites the .metadata of ``step`` with ``change(metadata)`` applied."""
    metadata = CheckpointReader(store.step_url(step)).read_metadata()
    change(metadata)
    with store.fs.open(f"{store.root}/step_{step:08d}/.metadata", "wb") as f:
        pickle.dump(metadata, f)


def set_entry(field: str, value: int):
    """A change of .metadata that sets ``field`` of the storage info of the table's first piece."""

    def change(metadata) -> None:
        index = next(i for i in metadata.storage_data if i.fqn == TABLE and i.offset[0] == 0)
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **{field: value})

    return change


def set_chunks(*chunks: tuple[tuple[int, int], tuple[int, int]]):
    """A change of .metadata that gives the table's pieces these (offsets, sizes)."""

    def change(metadata) -> None:
        table = metadata.state_dict_metadata[TABLE]
        table.chunks = [
            dataclasses.replace(table.chunks[0], offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks
        ]

    return change


@pytest.mark.parametrize(
    "change, problem",
    [
        (set_entry("offset", -1), "a negative offset or length"),
        (set_entry("length", -5), "a negative offset or length"),
        (set_chunks(((0, 0), (3, 4))), "pieces that do not tile it"),  # rows 3-5 left out
        (set_chunks(((0, 0), (3, 4)), ((3, 0), (2, 4))), "pieces that do not tile it"),  # row 5 left out
        (set_chunks(((0, 0), (4, 4)), ((3, 0), (3, 4))), "pieces that do not tile it"),  # row 3 twice
        (set_chunks(((0, 0), (3, 4)), ((3, 0), (3, 5))), "pieces that do not tile it"),  # a column beyond it
        (set_chunks(((0, 0), (2, 4)), ((2, 0), (4, 4))), "no entry for its piece at (2, 0)"),  # tiles, not as saved
    ],
    ids=[
        "negative offset",
        "negative length",
        "a piece missing",
        "a piece short",
        "pieces overlapping",
        "beyond",
        "a piece without entry",
    ],
)
def test_metadata_that_does_not_add_up_is_skipped_as_damaged(tmp_path, env, change, problem, caplog):
    store = saved(tmp_path / "ckpt", env)
    rewrite_metadata(store, 20, change)
    assert store.newest().step == 10
    assert f"skipping checkpoint {store.step_url(20)}: damaged" in caplog.text
    assert problem in caplog.text
