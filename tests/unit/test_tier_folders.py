"""A test module lies in the folder of its tier (tests/conftest.py): one elsewhere is a collection
error that names the folder to move it to."""

import sys

import pytest

from tests.conftest import REPO, TESTS, run, tier_folder_error

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"


@pytest.mark.parametrize("tier", ["unit", "integration", "slurm", "slow"])
def test_a_module_in_its_tiers_folder_passes(tier):
    assert tier_folder_error(TESTS / tier / "test_x.py", tier) is None


def test_a_module_in_another_tiers_folder_is_told_where_to_move():
    error = tier_folder_error(TESTS / "unit" / "test_x.py", "integration")
    assert error == (
        "tests/unit/test_x.py has TIER = 'integration' but lies in tests/unit/: move it to "
        "tests/integration/ (git mv tests/unit/test_x.py tests/integration/)"
    )


def test_a_module_at_the_top_of_tests_is_told_its_tiers_folder():
    error = tier_folder_error(TESTS / "test_x.py", "slow")
    assert error is not None and error.endswith("move it to tests/slow/ (git mv tests/test_x.py tests/slow/)")


def test_a_module_without_a_known_tier_is_left_to_the_tier_check():
    assert tier_folder_error(TESTS / "test_x.py", None) is None
    assert tier_folder_error(TESTS / "unit" / "test_x.py", "units") is None


@pytest.mark.integration  # a pytest of its own
def test_collecting_a_module_outside_its_tiers_folder_fails_naming_the_fix(tmp_path):
    (tmp_path / "test_elsewhere.py").write_text('TIER = "unit"\n\n\ndef test_x():\n    pass\n')
    args = ["-p", "tests.conftest", "-c", "pytest.ini", "--rootdir", REPO, "-p", "no:cacheprovider", "-n", "0"]
    result = run([sys.executable, "-m", "pytest", *args, "--collect-only", str(tmp_path / "test_elsewhere.py")])
    assert result.returncode == pytest.ExitCode.INTERRUPTED, result.stdout
    assert "1 error during collection" in result.stdout
    assert "test_elsewhere.py has TIER = 'unit' but lies in " in result.stdout
    assert "move it to tests/unit/" in result.stdout
