"""What the benchmarks' command lines share: their parser and common options, the ``--json``
report, and torchrun (how a benchmark starts the ranks it measures).

Each benchmark runs as ``python benchmarks/NAME.py`` and puts the repository on ``sys.path``
before it imports this module, as it does for the app.
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def positive(value: str) -> int:
    """An option's value that must be a whole number >= 1 (--repeats, --nproc)."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return int(value)


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its ``--help`` shows ``doc`` (the module's docstring, usage examples
    first) as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_repeats(parser: argparse.ArgumentParser, default: int, help: str = "measurements of each side") -> None:
    """--repeats: how many times each side is measured (the figures are their medians)."""
    parser.add_argument("--repeats", type=positive, default=default, help=f"{help} (default {default})")


def add_nproc(parser: argparse.ArgumentParser, help: str = "ranks on this machine") -> None:
    """--nproc: the ranks torchrun starts (default 2, the main job's ``-j 1x2``)."""
    parser.add_argument("--nproc", type=positive, default=2, help=f"{help} (default 2)")


def add_json(parser: argparse.ArgumentParser, what: str = "the figures") -> None:
    """--json FILE: where :func:`write_report` also writes ``what`` (none by default)."""
    parser.add_argument("--json", metavar="FILE", default="", help=f"also write {what} to FILE as JSON")


def add_app_args(parser: argparse.ArgumentParser) -> None:
    """The app's own options, after ``--``, handed to every training run."""
    parser.add_argument("app_args", nargs="*", help="more app options, after --")


def write_report(path: str, report: Any) -> None:
    """Writes ``report`` to ``path`` (the --json FILE) as indented JSON; nothing without --json."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """The command that runs ``target`` (a script and its arguments, or ``-m MODULE ...``) in
    ``nproc`` ranks on this machine: torchrun as a module of this interpreter, so that the ranks
    import what this process does."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *target]


def rank_env(**more: str) -> dict[str, str]:
    """This environment for the ranks, with ``more``: ``OMP_NUM_THREADS`` 1 unless it is set (the
    value torchrun would give them, without its warning)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **more}


def torchrun(
    nproc: int, target: list[str], env: dict[str, str] | None = None, what: str = ""
) -> subprocess.CompletedProcess:
    """Runs :func:`torchrun_command` in the repository (:func:`rank_env` with ``env``), its output
    captured; exits naming the command (and ``what`` run it was) and the end of its stderr where
    it fails."""
    cmd = torchrun_command(nproc, *target)
    result = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(**(env or {})), cwd=REPO)
    if result.returncode != 0:
        run = f"benchmark run failed ({what})" if what else "benchmark run failed"
        sys.exit(f"{run}: {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return result


def torchrun_figures(nproc: int, target: list[str]) -> dict[str, Any]:
    """:func:`torchrun` of a ``target`` whose rank 0 prints its figures as one JSON line, its
    output's last."""
    return json.loads(torchrun(nproc, target).stdout.strip().splitlines()[-1])
