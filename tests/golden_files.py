"""Golden files: reviewed, readable copies of what we generate, under tests/golden/.

A test compares what it generated (with run-to-run values such as app ids already replaced by
placeholders) with its golden file and fails on any difference, showing the diff. When a change
is intended, ``UPDATE_GOLDEN=1 pytest tests/...`` rewrites the files; review them with
``git diff tests/golden`` before committing.
"""

import difflib
import os

import pytest

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def assert_matches_golden(name: str, text: str) -> None:
    path = os.path.join(GOLDEN_DIR, name)
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        golden = f.read()
    if text != golden:
        diff = "\n".join(
            difflib.unified_diff(
                golden.splitlines(), text.splitlines(), f"tests/golden/{name}", "generated", lineterm=""
            )
        )
        pytest.fail(
            f"generated request differs from tests/golden/{name} (UPDATE_GOLDEN=1 "
            f"rewrites it; review the diff):\n{diff}",
            pytrace=False,
        )
