"""Damaged checkpoints (issue 24): a checkpoint whose files are not what it recorded, or whose
.metadata does not add up, is skipped with a warning, never resumed from, and never the reason
the last good one is deleted."""

import dataclasses
import json
import logging
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from apps.core.checkpoint.checkpointer import Checkpointed, Checkpointer, TrainState, open_checkpoints
from apps.core.checkpoint.folder import CheckpointStore
from apps.core.checkpoint.storage import writer
from apps.core.checkpoint.storage.errors import DamagedCheckpoint
from apps.core.checkpoint.storage.reader import CheckpointReader
from apps.core.common.distributed import DistEnv, free_port
from apps.dlrm.config import train_config
from apps.dlrm.model import TABLES
from tests.shards import sharded, whole

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


# --- checksums -----------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    """A model with a table of 64 KB: the shard bytes a damaged checkpoint loses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 16)


def run_checkpointer(cfg, env: DistEnv, model: torch.nn.Module) -> Checkpointer:
    """A run's checkpointer of ``model`` (SGD: no optimizer state), as training builds it."""
    optimizer = CombinedOptimizer(
        [("dense", KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1)))]
    )
    return Checkpointer(cfg, env, open_checkpoints(cfg, env), Checkpointed(model, optimizer, {}, TABLES), last_step=100)


def save_at(checkpointer: Checkpointer, model: Tiny, steps) -> dict[int, torch.Tensor]:
    """Saves the checkpoint of each of ``steps``, the table filled with values of its own; returns them."""
    tables = {}
    for step in steps:
        with torch.no_grad():
            model.emb.weight.copy_(torch.randn(1000, 16))
        tables[step] = model.emb.weight.detach().clone()
        checkpointer.save(TrainState(0, step, 0.5))
    checkpointer.wait()
    return tables


def overwrite(path, at: int, length: int) -> None:
    """Overwrites ``length`` bytes of the file ``path`` from ``at`` with others: its size stays."""
    data = bytearray(path.read_bytes())
    data[at : at + length] = bytes(255 - b for b in data[at : at + length])
    path.write_bytes(bytes(data))


def damage(step_dir, table: torch.Tensor, where: str) -> None:
    """Overwrites 4,000 bytes of the table's values in its shard, or its entry's archive headers
    (zip's central directory, at the entry's end), as a disk or a copy may."""
    metadata = CheckpointReader(str(step_dir)).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "model.emb.weight")
    shard = step_dir / info.relative_path
    if where == "values":
        overwrite(shard, shard.read_bytes().index(table.numpy().tobytes()) + 20_000, 4_000)
    else:
        overwrite(shard, info.offset + info.length - 100, 100)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["values", "headers"])
def test_a_damaged_shard_of_the_right_size_is_skipped_and_the_last_good_checkpoint_kept(
    tmp_path, env, where, background, caplog
):
    """Issue 24: 4,000 bytes of a table's shard overwritten resumed silently (loss nan), and the
    headers of its archive made the resume fail; then the last good checkpoint was pruned."""
    cfg = train_config(checkpoint_dir=str(tmp_path / "ckpt"), keep_last=2, checkpoint_async=background)
    model = Tiny()
    first = run_checkpointer(cfg, env, model)
    tables = save_at(first, model, [10, 20])
    first.close()
    damage(tmp_path / "ckpt" / "step_00000020", tables[20], where)

    second = run_checkpointer(cfg, env, model)
    assert second.resume_from.step == 20  # its files are all there, at their sizes
    state = TrainState(0)
    assert second.restore(state).step == 10
    assert state.step == 10 and torch.equal(model.emb.weight, tables[10])
    assert f"skipping checkpoint {tmp_path}/ckpt/step_00000020: damaged (" in caplog.text
    save_at(second, model, [20, 30])
    second.close()
    # the newest checkpoint that verified (the one resumed from) stays beside --keep_last 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000010", "step_00000020", "step_00000030"]


def test_a_checkpoint_found_damaged_is_not_counted_by_keep_last(tmp_path, env):
    """A damaged checkpoint no save replaces (step 25 here) is pruned, not kept instead of a good one."""
    cfg = train_config(checkpoint_dir=str(tmp_path / "ckpt"), keep_last=2, checkpoint_async=False)
    model = Tiny()
    first = run_checkpointer(cfg, env, model)
    tables = save_at(first, model, [10, 25])
    first.close()
    damage(tmp_path / "ckpt" / "step_00000025", tables[25], "values")
    second = run_checkpointer(cfg, env, model)
    assert second.restore(TrainState(0)).step == 10
    save_at(second, model, [20, 30])
    second.close()  # its run ends: it gives back the folder's LEASE, held while it saves
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000010", "step_00000020", "step_00000030"]


def test_a_checkpoint_without_checksums_still_loads_and_says_so(tmp_path, env, caplog):
    """Written before checksums were recorded: loaded unverified, as before."""
    cfg = train_config(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_async=False)
    model = Tiny()
    tables = save_at(run_checkpointer(cfg, env, model), model, [10])
    manifest = tmp_path / "ckpt" / "step_00000010" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "checksums"}))
    caplog.set_level(logging.INFO, logger="apps")
    with torch.no_grad():
        model.emb.weight.zero_()
    assert run_checkpointer(cfg, env, model).restore(TrainState(0)).step == 10
    assert torch.equal(model.emb.weight, tables[10])
    assert f"{tmp_path}/ckpt/step_00000010 has no checksums (written before they were recorded)" in caplog.text


@pytest.fixture(
    params=["local", "memory", pytest.param("s3", marks=pytest.mark.integration)], ids=["in place", "batched", "s3"]
)
def location(request, tmp_path):
    """A local folder (its files read in place), an in-memory one (read in fetched batches, as an
    object store), or a bucket on moto (files read whole streamed, as from S3)."""
    if request.param == "s3":
        import boto3

        request.getfixturevalue("aws")
        boto3.client("s3").create_bucket(
            Bucket="integrity", CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
        )
        return "s3://integrity/ckpt"
    return str(tmp_path / "ckpt") if request.param == "local" else f"memory://{tmp_path.name}/ckpt"


@pytest.mark.parametrize(
    "pieces",
    [[(0, 2, 0, 4), (2, 6, 0, 4)], [(0, 6, 0, 1), (0, 6, 1, 4)], [(0, 6, 0, 4)]],
    ids=["other rows", "columns", "whole"],
)
def test_a_resharded_load_verifies_the_bytes_it_reads(location, env, pieces, monkeypatch):
    """Checksums of 16-byte blocks here: each piece read, whatever its rows or columns, is checked."""
    monkeypatch.setattr(writer, "CHECKSUM_BLOCK_BYTES", 16)
    store = saved(location, env, steps=[10])
    target = {TABLE: sharded(torch.zeros(6, 4), pieces), "progress": torch.zeros(1)}
    store.load(store.newest(), target)
    assert torch.equal(whole(target[TABLE]), torch.arange(24, dtype=torch.float32).reshape(6, 4) + 10)
    shard = f"{store.root}/step_00000010/__0_0.distcp"
    data = bytearray(store.fs.cat_file(shard))
    at = data.index((torch.arange(12, dtype=torch.float32) + 10 + 12).numpy().tobytes())  # rows 3-5
    data[at + 45] ^= 1  # one bit of row 5
    store.fs.pipe_file(shard, bytes(data))
    with pytest.raises(DamagedCheckpoint, match="__0_0.distcp: bytes .* do not match their checksum"):
        store.load(store.newest(), target)


def grow_shard(folder) -> str:
    """Appends to the shard file; returns what the store should say of it."""
    size = (folder / "__0_0.distcp").stat().st_size
    with open(folder / "__0_0.distcp", "ab") as f:
        f.write(b"more")
    return f"shard file __0_0.distcp is {size + 4} bytes, not the {size} written"


def garble_checksums(folder) -> str:
    """Drops a checksum from the manifest; returns what the store should say of it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["checksums"]["files"]["__0_0.distcp"]["crc32"].pop()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return "manifest.json's checksums are malformed (a file's size and its blocks disagree)"


@pytest.mark.parametrize(
    "change", [grow_shard, garble_checksums], ids=["a shard longer than written", "checksums garbled"]
)
def test_files_that_differ_from_their_checksums_record_are_skipped_as_damaged(tmp_path, env, change, caplog):
    store = saved(tmp_path / "ckpt", env)
    problem = change(tmp_path / "ckpt" / "step_00000020")
    assert store.newest().step == 10
    assert f"skipping checkpoint {store.step_url(20)}: damaged ({problem})" in caplog.text
