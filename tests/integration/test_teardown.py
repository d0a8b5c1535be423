"""A rank ends without the interpreter's teardown (apps/core/common/teardown.py), where a Gloo
worker thread freeing a finished collective aborted jobs that had succeeded, and otherwise ends as
Python would: the same exit status, the exception printed, the exit handlers run, other threads
joined, everything printed written out."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

# Tier (tests/conftest.py): real processes (plain Python ones, a fraction of a second each).
TIER = "integration"


def ended(body: str, tmp_path) -> subprocess.CompletedProcess:
    """A process whose ``main`` is ``body``, ended by exit_without_teardown, with a thread pool
    left open, a slow thread that appends to ``tmp_path/log`` and an exit handler that does too."""
    code = (
        textwrap.dedent(
            f"""
        import atexit, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from apps.core.common.teardown import exit_without_teardown

        pool = ThreadPoolExecutor(1)  # left open, idle: its worker must not keep the process

        def note(text):
            with open({str(tmp_path / "log")!r}, "a") as f:
                f.write(text + "\\n")

        def main():
            threading.Thread(target=lambda: (time.sleep(0.3), note("thread"))).start()
            atexit.register(note, "exit handler")
            pool.submit(note, "pool").result()
            print("printed, not yet flushed")
        """
        )
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\nexit_without_teardown(main)\nnote('after')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize(
    "body, status, stderr",
    [
        ("return 'ignored'", 0, ""),
        ("sys.exit(2)", 2, ""),
        ("sys.exit('--data_path x is not a folder')", 1, "--data_path x is not a folder\n"),
        ("raise ValueError('bad')", 1, "ValueError: bad"),
    ],
)
def test_a_rank_ends_with_pythons_status_its_handlers_run_its_threads_joined(tmp_path, body, status, stderr):
    result = ended(body, tmp_path)
    assert result.returncode == status, result.stderr
    assert result.stdout == "printed, not yet flushed\n"
    assert stderr in result.stderr
    if "Error" in stderr:
        assert "Traceback (most recent call last)" in result.stderr
    # The open pool did not hang the exit, the thread ended before the handlers ran, nothing after main ran.
    assert (tmp_path / "log").read_text() == "pool\nthread\nexit handler\n"
