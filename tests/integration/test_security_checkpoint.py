"""Hostile input to checkpoints and run records: nothing planted in --checkpoint_dir runs code,
other jobs' folders there are never deleted, temporary files are never reached through a
planted link, and credentials in URLs are never recorded or logged."""

import json
import os
import pickle
import sys
import zipfile

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, MetadataIndex
from torchrec.optim.keyed import KeyedOptimizerWrapper

from apps.core.checkpoint.checkpointer import Checkpointed, Checkpointer, TrainState, open_checkpoints
from apps.core.checkpoint.folder import COMMIT_MARKER, Checkpoint, CheckpointStore
from apps.core.checkpoint.storage import stored_tensor
from apps.core.checkpoint.storage.errors import CheckpointError
from apps.core.checkpoint.storage.reader import CheckpointReader
from apps.core.common.distributed import DistEnv, free_port
from apps.core.training.report import Reporter
from apps.core.urls import redact_urls
from apps.dlrm.config import JobConfig, train_config
from apps.dlrm.model import TABLES
from tests.conftest import assert_ok, run, tiny

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


class RunsCode:
    """Unpickles as ``touch MARKER``: what an attacker would plant."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def world_of_one():
    """This process as a world of one rank, as the app runs without torchrun."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    dist.destroy_process_group()


def step_folder(root, name: str, owner: str | None = None, committed: bool = False):
    """A step folder another writer left: its OWNER says ``owner``, a shard file, maybe committed."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"their shard")
    if owner is not None:
        (folder / "OWNER").write_text(owner)
    if committed:
        (folder / COMMIT_MARKER).write_text("{}")
    return folder


def save_tiny(cfg: JobConfig, env: DistEnv, step: int) -> tuple[Checkpointer, str]:
    """A run's checkpointer, after the app's own save of a small model and optimizer."""
    model = torch.nn.Linear(2, 1)
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1))
    checkpointer = Checkpointer(cfg, env, open_checkpoints(cfg, env), Checkpointed(model, optimizer, {}, TABLES), step)
    url = checkpointer.save(TrainState(env.rank, step, 0.5))
    checkpointer.close()
    return checkpointer, url


# --- nothing in a checkpoint runs code -----------------------------------------------------------


@pytest.mark.unit
def test_a_planted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    folder = step_folder(tmp_path / "ckpt", "step_00000010", committed=True)
    (folder / "manifest.json").write_text("{}")
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=2)
    with pytest.raises(CheckpointError, match=r"step_00000010/\.metadata would load posix\.system, which is not"):
        store.newest()
    with pytest.raises(CheckpointException):  # DCP's wrapper of the same refusal
        store.load(Checkpoint(str(folder), 10, {}), {"progress": torch.zeros(2)})
    assert not marker.exists()


def builds_on(target: bytes, state: bytes) -> bytes:
    """A pickle that pushes ``target`` (pickle opcodes), then sets ``state`` (a dict, as opcodes) on it with
    pickle's BUILD as slot state, that is with setattr, and returns it."""
    return target + b"N}" + state + b"s\x86b."


def text(value: str) -> bytes:
    """``value`` as pickle's BINUNICODE opcode."""
    return b"X" + len(value).to_bytes(4, "little") + value.encode()


METADATA_MODULE = b"ctorch.distributed.checkpoint.metadata\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    "planted, shared, name",
    [
        # DCP's MetadataIndex made unhashable: every later checkpoint load of the process fails.
        (builds_on(METADATA_MODULE + b"MetadataIndex\n", text("__hash__") + b"N"), MetadataIndex, "__hash__"),
        # The member of DCP's enum that every TensorProperties shares, given another value.
        (
            builds_on(METADATA_MODULE + b"_MEM_FORMAT_ENCODING\nK\x01\x85R", text("_value_") + b"K\x07"),
            _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            "_value_",
        ),
    ],
    ids=["a class", "an enum member"],
)
def test_a_planted_metadata_changes_nothing_shared_by_the_process(tmp_path, planted, shared, name):
    """The unpickler sets state only on the objects it makes, never on a class or another object
    the whole process shares: refused before anything is set, though no code would run."""
    folder = step_folder(tmp_path / "ckpt", "step_00000010", committed=True)
    (folder / "manifest.json").write_text("{}")
    (folder / ".metadata").write_bytes(planted)
    before = vars(shared).get(name)
    try:
        with pytest.raises(CheckpointError, match=r"step_00000010/\.metadata would set attributes on "):
            CheckpointStore(str(tmp_path / "ckpt"), keep_last=2).newest()
        assert vars(shared).get(name) is before
    finally:  # the rest of the test process needs them as they were
        setattr(shared, name, before)
    assert hash(MetadataIndex("x")) == hash(MetadataIndex("x"))


@pytest.mark.unit
def test_a_planted_tensor_entry_changes_nothing_shared_by_the_process(tmp_path):
    """An entry whose header sets the defaults of the function the header reader builds tensor
    layouts with: every later plain tensor would then go through torch.load."""
    folder = tmp_path / "ckpt"
    dcp.save({"x": torch.zeros(4)}, storage_writer=FsspecWriter(str(folder)), no_dist=True)
    metadata = CheckpointReader(str(folder)).read_metadata()
    ((index, info),) = metadata.storage_data.items()
    with zipfile.ZipFile(folder / info.relative_path, "w") as archive:
        archive.writestr(
            "archive/data.pkl", builds_on(b"ctorch._utils\n_rebuild_tensor_v2\n", text("__defaults__") + b"K\x01\x85")
        )
        archive.writestr("archive/byteorder", sys.byteorder)
        archive.writestr("archive/version", "3\n")  # so that torch.load unpickles it too
    metadata.storage_data[index] = _StorageInfo(info.relative_path, 0, (folder / info.relative_path).stat().st_size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    before = stored_tensor._layout.__defaults__
    try:
        with pytest.raises(CheckpointException):
            CheckpointStore(str(tmp_path), keep_last=2).load(Checkpoint(str(folder), 10, {}), {"x": torch.zeros(4)})
        assert stored_tensor._layout.__defaults__ == before
    finally:
        stored_tensor._layout.__defaults__ = before


@pytest.mark.unit
def test_a_planted_byte_entry_is_refused_on_load_and_plain_data_still_loads(tmp_path):
    marker = tmp_path / "ran"
    hostile, plain = tmp_path / "ckpt" / "step_00000010", tmp_path / "ckpt" / "step_00000020"
    dcp.save({"progress": RunsCode(marker)}, storage_writer=FsspecWriter(str(hostile)), no_dist=True)
    dcp.save({"groups": {"lr": 0.5}}, storage_writer=FsspecWriter(str(plain)), no_dist=True)
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=2)
    with pytest.raises(CheckpointException, match="entry progress holds a pickled object, not plain data"):
        store.load(Checkpoint(str(hostile), 10, {}), {"progress": torch.zeros(2)})
    assert not marker.exists()
    state = {"groups": {"lr": 0.0}}
    store.load(Checkpoint(str(plain), 20, {}), state)
    assert state == {"groups": {"lr": 0.5}}


# --- other jobs' folders ----------------------------------------------------------------------


@pytest.mark.unit
def test_pruning_deletes_only_this_runs_folders_of_our_names(tmp_path, world_of_one):
    root = tmp_path / "ckpt"
    theirs = [
        step_folder(root, "step_000000002", owner="ours", committed=True),  # not a name we write
        step_folder(root, "step_00000005", owner="theirs", committed=True),
        step_folder(root, "step_00000015", owner="theirs"),  # another job, writing now
        step_folder(root, "step_00000016"),  # no owner: a job of an older version
    ]
    ours_dead = step_folder(root, "step_00000017", owner="ours")  # an attempt of ours that died
    store = CheckpointStore(str(root), keep_last=1)
    store.run_id = "ours"
    for step in (10, 20):
        store.save(step, {"x": torch.ones(2)}, {}, world_of_one)
    assert sorted(os.listdir(root)) == sorted([folder.name for folder in theirs] + ["step_00000020"])
    assert not ours_dead.exists()
    assert all((folder / "__0_0.distcp").read_bytes() == b"their shard" for folder in theirs)


@pytest.mark.unit
def test_a_step_folder_of_another_job_is_never_overwritten(tmp_path, world_of_one):
    folder = step_folder(tmp_path / "ckpt", "step_00000010", owner="theirs")
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=2)
    store.run_id = "ours"
    with pytest.raises(CheckpointError, match="step_00000010 exists already, written by run theirs, not by this run"):
        store.save(10, {"x": torch.ones(2)}, {}, world_of_one)
    assert sorted(os.listdir(folder)) == ["OWNER", "__0_0.distcp"]
    assert (folder / "__0_0.distcp").read_bytes() == b"their shard"


@pytest.mark.unit
def test_a_run_that_would_save_over_another_jobs_folder_is_refused_before_training(tmp_path, world_of_one):
    """Not after training up to that step: the folder is found at start-up."""
    root = tmp_path / "ckpt"
    step_folder(root, "step_00000015", owner="theirs")  # a step this run never saves: no matter
    cfg = train_config(checkpoint_dir=str(root), checkpoint_every=10, steps=40)
    assert open_checkpoints(cfg, world_of_one).resume_from is None
    folder = step_folder(root, "step_00000030", owner="theirs")
    with pytest.raises(CheckpointError, match="step_00000030 exists already, written by run theirs"):
        open_checkpoints(cfg, world_of_one)
    assert sorted(os.listdir(folder)) == ["OWNER", "__0_0.distcp"]


@pytest.mark.unit
def test_a_resumed_run_keeps_its_run_id_and_prunes_what_it_wrote_before(tmp_path, world_of_one):
    cfg = train_config(checkpoint_dir=str(tmp_path / "ckpt"), keep_last=1)
    first, _ = save_tiny(cfg, world_of_one, step=10)
    assert first.resume_from is None and first.store.run_id
    # a restart: a new process, the same command
    second, _ = save_tiny(cfg, world_of_one, step=20)
    resume_from = second.resume_from
    assert resume_from.step == 10 and resume_from.manifest["run_id"] == second.store.run_id == first.store.run_id
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000020"]


# --- temporary files --------------------------------------------------------------------------


@pytest.mark.unit
def test_summary_is_never_written_through_a_planted_link(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_text("precious")
    os.symlink(victim, out / "summary.json.tmp")  # the name earlier versions wrote to
    reporter = Reporter(str(out), enabled=True)
    reporter.write_summary({"steps": 1})
    reporter.close()
    assert victim.read_text() == "precious"
    assert not os.path.islink(out / "summary.json")
    assert json.loads((out / "summary.json").read_text()) == {"steps": 1}
    assert sorted(os.listdir(out)) == ["summary.json", "summary.json.tmp"]  # tensorboard/: on the first scalars


# --- credentials in URLs ----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, redacted",
    [
        ("s3://AKIAKEY:SeCrEt@bucket/ckpt", "s3://***@bucket/ckpt"),
        ("sftp://user:pass@host:22/data", "sftp://***@host:22/data"),
        ("gs://token@bucket", "gs://***@bucket"),
        ("s3://key:p@ss@bucket/x", "s3://***@bucket/x"),  # an unescaped "@" in the password
        ("from s3://k:s@a/x to sftp://u:p@b/y failed", "from s3://***@a/x to sftp://***@b/y failed"),
        ("s3://bucket/user@example.com/x", "s3://bucket/user@example.com/x"),  # "@" in the path
        ("/data/criteo and memory://x", "/data/criteo and memory://x"),
    ],
)
def test_credentials_in_urls_are_redacted(text, redacted):
    assert redact_urls(text) == redacted


@pytest.mark.unit
def test_a_checkpoint_records_its_url_without_credentials(tmp_path, world_of_one):
    url = f"memory://AKIAKEY:SeCrEt@{tmp_path.name}/ckpt"
    cfg = train_config(checkpoint_dir=url)
    _, step_url = save_tiny(cfg, world_of_one, step=10)
    with fsspec.open(f"{step_url}/manifest.json", "r") as f:
        manifest = f.read()
    assert "SeCrEt" not in manifest
    assert json.loads(manifest)["config"]["checkpoint_dir"] == f"memory://***@{tmp_path.name}/ckpt"
    metadata = CheckpointReader(step_url).read_metadata()
    assert metadata.storage_meta.checkpoint_id == f"memory://***@{tmp_path.name}/ckpt/step_00000010"


def test_a_run_logs_and_summarises_its_urls_without_credentials(tmp_path):
    url = "memory://AKIAKEY:SeCrEt@bucket/ckpt"
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *tiny(steps=10),
            "--checkpoint_dir",
            url,
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert_ok(result)
    summary = (tmp_path / "out" / "summary.json").read_text()
    assert "SeCrEt" not in result.stderr + result.stdout + summary
    assert "step 10: checkpoint committed at memory://***@bucket/ckpt/step_00000010" in result.stderr
    assert json.loads(summary)["config"]["checkpoint_dir"] == "memory://***@bucket/ckpt"
