"""A disk that fills up while a checkpoint is saved (issue 24, item 4): the run says so, naming the
folder and the space a checkpoint needs, records the failure in summary.json, and keeps the
committed checkpoints. The disk is a real one: a small tmpfs, mounted in a mount namespace of the
run's own (so nothing is left mounted, whatever happens)."""

import json
import os
import re
import shlex
import sys
import textwrap

import pytest

from apps.core.checkpoint.folder import CheckpointStore
from tests.conftest import run, tiny

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.mark.parametrize("background", ["false", "true"], ids=["sync", "async"])
def test_a_full_disk_is_said_recorded_in_the_summary_and_the_committed_checkpoints_kept(tmp_path, background):
    disk, out, kept = tmp_path / "disk", tmp_path / "out", tmp_path / "kept"
    disk.mkdir()
    ckpt = disk / "ckpt"
    train = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        *("-m", "apps.dlrm.train", *tiny(steps=20), "--checkpoint_every", "10", "--keep_last", "2"),
        *("--checkpoint_async", background, "--checkpoint_dir", str(ckpt), "--output_dir", str(out)),
    ]
    # 6 MB: the checkpoint of step 10 (3.9 MB) fits, step 20's does not. What is on the disk is
    # copied out before the namespace, and its disk, go.
    script = f"mount -t tmpfs -o size=6m tmpfs {disk} && {{ {shlex.join(train)}; status=$?; cp -a {ckpt} {kept}; exit $status; }}"
    result = run(["unshare", "--mount", "sh", "-c", script])
    assert result.returncode != 0
    log = result.stdout + result.stderr
    said = rf"no space left on {re.escape(str(ckpt))} \(need ~0\.00[34]\d* GB for a checkpoint\)"  # 3.9 MB of shards
    assert re.search(said, log), log[-5000:]
    # no rank's traceback (torch prefixes their lines with [rankN]:); torchrun's own, of a worker that failed, stays
    assert "enforce fail" not in log and "]: Traceback" not in log
    summary = json.loads((out / "summary.json").read_text())
    assert re.match(said, summary["failed"])
    assert summary["steps"] == 20
    store = CheckpointStore(str(kept), keep_last=2)
    assert store.steps() == [10] and store.newest().step == 10


@pytest.mark.parametrize("write", ["claim", "commit"])
def test_a_disk_full_for_a_checkpoints_small_files_is_said_in_one_line(tmp_path, write):
    """The folder and owner file made before the shards, the manifest and commit marker after
    them: a full disk there too is one line (SaveFailed), the checkpoint left uncommitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    code = textwrap.dedent(
        f"""
        import os
        from apps.core.checkpoint.folder import CheckpointStore
        from apps.core.checkpoint.storage.checksums import Checksums
        from apps.core.checkpoint.storage.errors import SaveFailed

        store = CheckpointStore({str(disk / "ckpt")!r}, keep_last=2)
        store.run_id = "run-1"
        if {write!r} == "commit":
            store._claim(10)
        with open({str(disk / "filler")!r}, "wb", buffering=0) as f:  # the disk full from here on
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        try:
            store._claim(10) if {write!r} == "claim" else store._commit(10, {{}}, None, Checksums(4096, {{}}))
        except SaveFailed as e:
            print("said:", e)
        print("steps:", store.steps())
        """
    )
    script = f"mount -t tmpfs -o size=256k tmpfs {disk} && {shlex.join([sys.executable, '-c', code])}"
    result = run(["unshare", "--mount", "sh", "-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
    said = f"said: no space left on {disk / 'ckpt'} for step 10's checkpoint (its {'folder' if write == 'claim' else 'manifest'})"
    assert said in result.stdout, result.stdout + result.stderr[-3000:]
    assert "steps: []" in result.stdout
