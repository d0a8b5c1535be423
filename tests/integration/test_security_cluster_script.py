"""scripts/slurm_cluster.sh runs as root in /var/tmp, a folder everyone can write to: it must not
follow a planted link or use a folder someone else made (issue: hardening, item 3). These run
its `stop`, which takes the lock first and needs nothing built."""

import os
import subprocess

import pytest

from tests.conftest import REPO

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

SCRIPT = os.path.join(REPO, "scripts", "slurm_cluster.sh")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the script runs as root only")


def script(command: str, home) -> subprocess.CompletedProcess:
    # A port of its own: the cluster's network namespaces are named after it, and a running
    # cluster's must not be touched.
    env = {**os.environ, "SLURM_CLUSTER_HOME": str(home), "SLURM_CLUSTER_PORT": "16997"}
    return subprocess.run([SCRIPT, command], env=env, capture_output=True, text=True, timeout=60)


def stop(home) -> subprocess.CompletedProcess:
    return script("stop", home)


@pytest.mark.unit
def test_its_own_folder_works(tmp_path):
    result = stop(tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(tmp_path / "home" / "lock")


@pytest.mark.unit
def test_a_planted_lock_link_is_refused_and_its_target_left_alone(tmp_path):
    home, victim = tmp_path / "home", tmp_path / "victim"
    home.mkdir()
    victim.write_text("precious")
    (home / "lock").symlink_to(victim)
    result = stop(home)
    assert result.returncode == 1 and "lock is a symbolic link" in result.stderr
    assert victim.read_text() == "precious"


@pytest.mark.unit
@pytest.mark.parametrize(
    "plant, fragment",
    [
        (lambda home, elsewhere: home.symlink_to(elsewhere, target_is_directory=True), "is a symbolic link"),
        (lambda home, elsewhere: (home.mkdir(), os.chown(home, 12345, 12345)), "belongs to user id 12345, not root"),
        (lambda home, elsewhere: (home.mkdir(), home.chmod(0o777)), "can be written by other users (mode 777)"),
    ],
)
def test_a_folder_someone_else_could_have_made_is_refused(tmp_path, plant, fragment):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(home, elsewhere)
    result = stop(home)
    assert result.returncode == 1 and fragment in result.stderr, result.stderr
    assert not os.path.exists(elsewhere / "lock") and not os.path.exists(tmp_path / "home" / "lock")


@pytest.mark.unit
def test_a_cluster_root_of_another_user_is_never_chrooted_into(tmp_path):
    """`start` on a root that someone else owns stops before using it (before any daemon)."""
    home = tmp_path / "home"
    state = os.path.dirname(script("bin", home).stdout.strip())  # bin lives in the cluster's state folder
    os.makedirs(os.path.join(state, "root"))
    os.chown(os.path.join(state, "root"), 12345, 12345)
    result = script("start", home)
    assert result.returncode == 1 and "root belongs to user id 12345, not root" in result.stderr, result.stderr
