"""Checkpoints: atomic, sharded, exact to resume, reshardable, at any fsspec URL, and refused
early when they or their location cannot be used."""

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import fsspec
import pytest
import torch

from apps.core.checkpoint.checkpointer import CheckpointError, check_compatible, open_checkpoints
from apps.core.checkpoint.folder import COMMIT_MARKER, Checkpoint, CheckpointStore
from apps.core.checkpoint.reshard import column_map
from apps.core.common.distributed import DistEnv
from apps.core.config import SHARDING_TYPES
from apps.core.training.lean import step_kind
from apps.dlrm.config import train_config
from tests.conftest import BIN, LOCAL_TRAIN_1X2, REPO, TINY, assert_ok, run, tiny, torchrun, trainer_pids
from tests.shards import assemble, saved_tensors

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


def train_app(tmp, name, *args, nproc=2, **kwargs):
    """Runs the app under torchrun; returns (result, summary or None)."""
    out = tmp / name
    result = torchrun(["-m", "apps.dlrm.train", *TINY, "--output_dir", str(out), *args], nproc=nproc, **kwargs)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return result, summary


def listing(path) -> dict[str, tuple[int, float]]:
    """Every file under ``path`` with its size and modification time."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            files[os.path.relpath(os.path.join(root, name), path)] = (stat.st_size, stat.st_mtime_ns)
    return files


# What makes an exact resume hardest: dense Adam (its state is made lazily, at the first step, so a
# resumed run must make it before loading the saved one into it) and multi-hot features, mean-pooled.
RECIPE = [
    "--dense_optimizer",
    "adam",
    "--multi_hot_sizes",
    ",".join(str(1 + i % 4) for i in range(26)),
    "--pooling",
    "mean",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """40 steps of RECIPE on 2 ranks, a checkpoint every 10 steps, the last 2 kept."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result, summary = train_app(
        tmp, "out", *RECIPE, "--checkpoint_dir", str(tmp / "ckpt"), "--checkpoint_every", "10", "--keep_last", "2"
    )
    assert_ok(result)
    return tmp / "ckpt", summary


def test_commits_every_interval_and_keeps_the_last(uninterrupted):
    ckpt, summary = uninterrupted
    assert summary["resumed_from_step"] is None
    # the last 2 kept; BEST marks the best validation's (the last step's: the one validation)
    assert sorted(os.listdir(ckpt)) == ["BEST", "step_00000030", "step_00000040"]
    for step in (30, 40):
        directory = ckpt / f"step_{step:08d}"
        names = set(os.listdir(directory))
        assert {COMMIT_MARKER, "manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= names
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["world_size"] == 2
        assert manifest["model"]["table_sizes"] == [2000] * 26
        assert set(manifest["versions"]) >= {"torch", "torchrec", "torchx-nightly"}
        assert len(manifest["sharding_plan"]) == 26
        assert manifest["config"]["checkpoint_every"] == 10


def test_resume_continues_exactly_where_it_stopped(uninterrupted, tmp_path):
    _, reference = uninterrupted
    ckpt = str(tmp_path / "ckpt")
    first, stopped = train_app(tmp_path, "first", *RECIPE, "--checkpoint_dir", ckpt, "--steps", "20")
    assert_ok(first)
    # the same command again, with the full step count: no flag says "resume"
    second, resumed = train_app(tmp_path, "second", *RECIPE, "--checkpoint_dir", ckpt, "--checkpoint_every", "10")
    assert_ok(second)
    assert stopped["resumed_from_step"] is None and resumed["resumed_from_step"] == 20
    assert resumed["steps"] == 40
    assert resumed["final_train_loss"] == reference["final_train_loss"]  # bit for bit
    assert resumed["val_auroc"] == reference["val_auroc"]


def assert_resumes_resharded(step_dir, tmp_path, nproc: int, sharding: str, step: int, args=()) -> None:
    """Resumes ``step_dir``'s checkpoint (saved with the options ``args``) on ``nproc`` ranks with
    ``sharding``; the tables and their optimizer state equal what was saved."""
    runs = tmp_path / "runs.json"
    runs.write_text(
        json.dumps(
            [
                {
                    "args": [*TINY, *args, "--sharding_type", sharding],
                    "resume": [str(step_dir.parent)],
                    "dump": str(tmp_path / "dump"),
                }
            ]
        )
    )
    result = torchrun([f"{REPO}/tests/checkpoint_worker.py", str(runs)], nproc=nproc)
    assert_ok(result)
    dumps = [torch.load(tmp_path / f"dump.0.rank{r}.pt") for r in range(nproc)]
    assert {s["type"] for s in dumps[0]["plan"].values()} == {sharding}
    assert dumps[0]["progress"]["step"] == step
    pieces = [d["pieces"] for d in dumps]
    names = [
        n
        for n in pieces[0]
        if ("embedding_bags" in n and n.startswith("model."))
        or (n.startswith("optimizer.state.fused") and n.endswith("momentum1"))
    ]
    assert len(names) == 2 * 26  # every table and its row-wise Adagrad state
    expected = saved_tensors(str(step_dir), names)
    for name in names:
        assert torch.equal(assemble(pieces, name, tuple(expected[name].shape)), expected[name]), name


def test_two_rank_checkpoint_resumes_on_one_rank_row_wise(uninterrupted, tmp_path):
    ckpt, _ = uninterrupted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    assert_resumes_resharded(
        tmp_path / "ckpt" / "step_00000040", tmp_path, nproc=1, sharding="row_wise", step=40, args=RECIPE
    )


def test_one_rank_checkpoint_resumes_on_two_ranks_table_row_wise(tmp_path):
    result, _ = train_app(tmp_path, "one", "--checkpoint_dir", str(tmp_path / "ckpt"), "--steps", "10", nproc=1)
    assert_ok(result)
    assert_resumes_resharded(tmp_path / "ckpt" / "step_00000010", tmp_path, nproc=2, sharding="table_row_wise", step=10)


def test_one_ranks_lean_and_sharded_steps_resume_each_others_checkpoints_exactly(tmp_path):
    """On one rank the lean step (apps/core/training/lean.py) saves what TorchRec's sharded step
    saves: each resumes the other's checkpoint and ends where 40 uninterrupted steps end."""
    whole, reference = train_app(tmp_path, "whole", *RECIPE, "--checkpoint_dir", str(tmp_path / "whole"), nproc=1)
    assert_ok(whole)
    for first, then in (("auto", "false"), ("false", "auto")):
        ckpt = str(tmp_path / f"ckpt-{first}")
        stopped, _ = train_app(
            tmp_path, f"{first}-20", *RECIPE, "--checkpoint_dir", ckpt, "--steps", "20", "--lean_step", first, nproc=1
        )
        assert_ok(stopped)
        resumed, summary = train_app(
            tmp_path, f"{then}-40", *RECIPE, "--checkpoint_dir", ckpt, "--lean_step", then, nproc=1
        )
        assert_ok(resumed)
        said = [line.split("training step: ")[1] for line in resumed.stderr.splitlines() if "training step: " in line]
        refusal = "" if then == "auto" else "--lean_step false"
        assert said == [step_kind(refusal, "TrainPipelineSparseDist")], said
        assert summary["resumed_from_step"] == 20 and summary["steps"] == 40
        assert summary["final_train_loss"] == reference["final_train_loss"], (first, then)  # bit for bit
        assert summary["val_auroc"] == reference["val_auroc"]


def test_uncommitted_and_damaged_checkpoints_are_skipped(uninterrupted, tmp_path, caplog):
    ckpt, _ = uninterrupted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_last=2)
    assert store.newest().step == 40
    newest = tmp_path / "ckpt" / "step_00000040"
    (newest / COMMIT_MARKER).rename(tmp_path / "marker")
    assert store.newest().step == 30
    assert "step_00000040: not committed" in caplog.text
    (tmp_path / "marker").rename(newest / COMMIT_MARKER)
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert store.newest().step == 30
    assert "shard file __1_0.distcp is missing or truncated" in caplog.text
    (tmp_path / "ckpt" / "step_00000030" / ".metadata").write_bytes(b"garbage")
    assert store.newest() is None
    assert "step_00000030: damaged" in caplog.text


def test_a_shard_damaged_in_place_is_skipped_and_the_last_good_checkpoint_kept(uninterrupted, tmp_path):
    """Issue 24: 4,000 bytes of an embedding shard of the newest checkpoint overwritten, its size
    unchanged, resumed silently ("loss nan"), and the next commit pruned the last good one."""
    ckpt, _ = uninterrupted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "step_00000040" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4000] = bytes(4000)
    shard.write_bytes(bytes(data))
    args = ["--checkpoint_dir", str(tmp_path / "ckpt"), "--steps", "50", "--checkpoint_every", "10", "--keep_last", "2"]
    result, summary = train_app(tmp_path, "out", *RECIPE, *args)
    assert_ok(result)
    assert f"skipping checkpoint {tmp_path}/ckpt/step_00000040: damaged (" in result.stderr
    assert summary["resumed_from_step"] == 30 and math.isfinite(summary["final_train_loss"])
    # 40 and 50 are the two newest; 30, the one that verified, stays beside them
    steps = sorted(name for name in os.listdir(tmp_path / "ckpt") if name.startswith("step_"))
    assert steps == ["step_00000030", "step_00000040", "step_00000050"]


def test_incompatible_checkpoint_is_refused_before_training_and_kept(uninterrupted, tmp_path):
    ckpt, _ = uninterrupted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    before = listing(tmp_path / "ckpt")
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *TINY,
            *RECIPE,
            "--num_embeddings",
            "3000",
            "--checkpoint_dir",
            str(tmp_path / "ckpt"),
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert result.returncode == 2
    assert "was written for another model (table_sizes: 26x2000 there, 26x3000 here)" in result.stderr
    assert "step 20/40" not in result.stderr
    assert listing(tmp_path / "ckpt") == before


def test_unwritable_local_directory_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *TINY,
            "--output_dir",
            str(tmp_path / "out"),
            "--checkpoint_dir",
            str(tmp_path / "file" / "ckpt"),
        ]
    )
    assert result.returncode == 2
    assert f"--checkpoint_dir {tmp_path / 'file' / 'ckpt'} is not writable" in result.stderr
    assert "Give --checkpoint_dir a folder (new or one of checkpoints), not a file." in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def make_bucket(name: str) -> None:
    import boto3

    boto3.client("s3").create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})


def test_checkpoints_on_s3_resume(aws, tmp_path):
    make_bucket("dlrm-ckpt")
    url = "s3://dlrm-ckpt/runs/a"
    first, _ = train_app(tmp_path, "first", "--checkpoint_dir", url, "--steps", "20")
    assert_ok(first)
    s3 = fsspec.filesystem("s3")
    assert s3.exists("dlrm-ckpt/runs/a/step_00000020/COMMITTED")
    second, summary = train_app(tmp_path, "second", "--checkpoint_dir", url, "--steps", "30")
    assert_ok(second)
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 30
    assert s3.exists("dlrm-ckpt/runs/a/step_00000030/COMMITTED")


def test_checkpoints_on_gcs_resume(gcs, tmp_path):
    fs = fsspec.filesystem("gs")
    fs.mkdir("dlrm-ckpt-gcs")
    url = "gs://dlrm-ckpt-gcs/runs/a"
    first, trained = train_app(tmp_path, "first", "--checkpoint_dir", url, "--steps", "20")
    assert_ok(first)
    assert fs.exists("dlrm-ckpt-gcs/runs/a/step_00000020/COMMITTED")
    # A rerun of the finished job has nothing left to do; evaluating the checkpoint loads it back.
    second, resumed = train_app(tmp_path, "second", "--checkpoint_dir", url, "--evaluate_checkpoint", "latest")
    assert_ok(second)
    assert resumed["evaluated_step"] == 20
    assert resumed["val_auroc"] == trained["val_auroc"]  # the same model came back


@pytest.mark.parametrize(
    "url, unset, messages",
    [
        (
            "s3://no-such-bucket/ckpt",
            [],
            ["--checkpoint_dir s3://no-such-bucket/ckpt is not writable", "Create the bucket 'no-such-bucket' first"],
        ),
        (
            "s3://dlrm-ckpt/ckpt",
            ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
            [
                "--checkpoint_dir s3://dlrm-ckpt/ckpt cannot be reached: no AWS credentials were found: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), run `aws configure`"
            ],
        ),
    ],
)
def test_unusable_s3_location_is_refused_at_start(aws, tmp_path, monkeypatch, url, unset, messages):
    make_bucket("dlrm-ckpt")
    for name in unset:
        monkeypatch.delenv(name)
    result = run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            *TINY,
            "--checkpoint_dir",
            url,
            "--output_dir",
            str(tmp_path / "out"),
        ],
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert all(message in result.stderr for message in messages), result.stderr[-3000:]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_killed_trainer_is_restarted_from_the_last_checkpoint(tmp_path):
    """A restart says so in one line, not in the surviving rank's traceback (issue 23), which its
    error file keeps in the folder the line names."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    job = subprocess.Popen(
        [
            *LOCAL_TRAIN_1X2,
            "--max_retries",
            "1",
            # torchrun looks at its trainers every 3 s, not every 0.1 s: the surviving rank then
            # fails on the lost one's absence (gloo: "Connection reset by peer") before torchrun
            # stops it, as on a host that does not see another host's death.
            "--env",
            "PET_MONITOR_INTERVAL=3",
            *tiny(steps=400),
            "--checkpoint_every",
            "50",
            "--checkpoint_dir",
            str(ckpt),
            "--output_dir",
            str(out),
        ],
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 300
    while not (ckpt / "step_00000050" / COMMIT_MARKER).exists():
        assert job.poll() is None and time.time() < deadline, "no checkpoint was committed"
        time.sleep(0.05)
    committed = max(int(d.split("_")[1]) for d in os.listdir(ckpt) if (ckpt / d / COMMIT_MARKER).exists())
    victim = trainer_pids(str(ckpt))[0]
    os.kill(victim, signal.SIGKILL)
    log, _ = job.communicate(timeout=600)
    assert job.returncode == 0, log[-5000:]
    assert "SUCCEEDED" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 400
    # no more than one checkpoint interval was redone
    assert summary["resumed_from_step"] >= committed
    assert f"resumed from {ckpt}/step_" in log
    said = [line for line in log.splitlines() if "restarting the trainers" in line]
    assert len(said) == 1, log[-5000:]
    assert re.search(
        r"apps\.dlrm\.torchrun: rank [01] died \(SIGKILL\); restarting the trainers \(restart 1 of 1\)", said[0]
    )
    assert not [text for text in ("Traceback", "Connection reset", "Connection closed") if text in log], log[-5000:]
    attempt = pathlib.Path(said[0].split("the failed attempt's logs and errors: ", 1)[1])
    assert attempt.parent.parent == out / "torchrun"
    (survivor,) = [json.loads(f.read_text())["message"] for f in attempt.glob("*/error.json")]
    assert "Traceback" in survivor["extraInfo"]["py_callstack"] and "RuntimeError" in survivor["message"]


# --- pure logic ------------------------------------------------------------------------------


@pytest.mark.unit
def test_prune_deletes_only_after_a_newer_commit():
    store = CheckpointStore("memory://prune-test/ckpt", keep_last=2)
    store.run_id = "this-run"
    fs = store.fs
    for step, committed in [(10, True), (20, True), (25, False), (30, True), (40, False)]:
        fs.pipe(f"{store.root}/step_{step:08d}/OWNER", b"this-run")
        if committed:
            fs.pipe(f"{store.root}/step_{step:08d}/{COMMIT_MARKER}", b"{}")
    store._prune(newest=30)
    # 10 goes (beyond keep_last), 25 goes (uncommitted, older than a commit), 40 stays: it
    # may be the newer checkpoint some other writer is still producing
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(store.root, detail=False)) == [
        "step_00000020",
        "step_00000030",
        "step_00000040",
    ]


#: The column blocks TorchRec gives a table of 256 columns under each sharding type: column-wise
#: splits it into shards of 128 columns (its minimum), the others keep whole rows.
COLUMN_BLOCKS = {"column_wise": ((0, 128), (128, 128))}


@pytest.mark.unit
@pytest.mark.parametrize("saved", SHARDING_TYPES[1:])
@pytest.mark.parametrize("current", SHARDING_TYPES[1:])
def test_which_sharding_changes_keep_the_optimizer_state(saved, current):
    """All of them: a checkpoint of the same model resumes under any sharding, and its
    optimizer state comes along (tests/integration/test_reshard.py resumes each pair). Row-wise state is
    exact but where whole rows become column shards: each shard then gets the row's mean."""
    cfg = train_config(embedding_dim=256, dense_arch_layer_sizes=[64, 256])
    manifest = {"model": cfg.model_signature(), "sharding_plan": {"t_cat_0": {"type": saved, "ranks": [0, 1]}}}
    check_compatible(Checkpoint("file:///ckpt/step_00000010", 10, manifest), cfg)
    whole = ((0, 256),)
    exact = column_map(COLUMN_BLOCKS.get(saved, whole), COLUMN_BLOCKS.get(current, whole)).exact
    assert exact == (current != "column_wise" or saved == "column_wise")


@pytest.mark.unit
def test_memory_urls_are_refused_for_several_ranks():
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(CheckpointError, match="memory:// lives inside one process"):
        open_checkpoints(train_config(checkpoint_dir="memory://x"), env)
