"""Time to the first training step: the README's main job against plain torchrun, in the same run.

    python benchmarks/startup.py                  # medians of 3, 2 ranks, the main job's model
    python benchmarks/startup.py --repeats 5 --json startup.json

Each side is started as its user starts it, a fresh command, and timed from that moment until
its output says that the first training step is done:

- ours: ``torchx run -s local_cwd components.dlrm:train -j 1xN --log_every 1`` (the README's main
  job; its run folder under a temporary folder), whose rank 0 logs ``step 1/1500 ...`` once
  step 1 has trained and its loss is back from the device: TorchX's submission, our launcher,
  torchrun, the trainers' imports, configuration, process group, sharding plan, model, data and
  the step.
- plain: ``torchrun --standalone --nproc_per_node N benchmarks/plain_torchrec_loop.py --steps 1``, the same
  DLRM trained with TorchRec as its examples do (default planner, DMP, TrainPipelineSparseDist,
  the same synthetic batches), whose rank 0 prints its JSON line once step 1 is done.

Either is then stopped (SIGTERM to ``torchx``, which stops its trainers, or to ``torchrun``,
which stops its workers) before the next starts. The sides alternate (ours first in even
repeats), ``--repeats`` times each; the ratio is ours' median over plain's (target <= 1.2).
Output goes to a log file per start, polled every 20 ms for the line, which each side's time
shares alike.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import cli  # noqa: E402

PLAIN_LOOP = os.path.join(REPO, "benchmarks", "plain_torchrec_loop.py")
POLL_S = 0.02
STOP_S = 60  # for a stopped job's processes to end


@dataclass(frozen=True)
class Side:
    """One way to start the same training: its command and the output line of its step 1."""

    name: str
    command: list[str]
    step_one: re.Pattern

    def time_to_first_step(self, log_path: str, timeout: float) -> float:
        """Seconds from starting the command until its output has the step-1 line; the command
        is then stopped. Exits naming the log where the command ends or times out first."""
        with open(log_path, "w") as log:
            start = time.perf_counter()
            proc = subprocess.Popen(self.command, cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            with open(log_path) as out:
                seen = ""
                while time.perf_counter() - start < timeout:
                    seen += out.read()
                    if self.step_one.search(seen):
                        return time.perf_counter() - start
                    if proc.poll() is not None:
                        sys.exit(f"startup: {self.name} ended (exit {proc.returncode}) before step 1; see {log_path}")
                    time.sleep(POLL_S)
            sys.exit(f"startup: {self.name} did not reach step 1 in {timeout:.0f} s; see {log_path}")
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stops ``proc`` (torchx or torchrun, which stop their trainers on SIGTERM) and waits for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def job_env() -> dict[str, str]:
    """This environment, with the project importable from any directory (the plain loop uses
    the app's configuration and synthetic data, so that both train the same model on the same
    batches)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else REPO}


def sides(nproc: int, runs: str) -> tuple[Side, Side]:
    """(ours, plain) for ``nproc`` ranks on this machine; ours writes its run folders in ``runs``."""
    ours = Side(
        "ours",
        [
            os.path.join(os.path.dirname(sys.executable), "torchx"),
            "run",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            "-j",
            f"1x{nproc}",
            "--log_every",
            "1",
            "--output_dir",
            os.path.join(runs, "{run}"),
        ],
        re.compile(r"INFO step 1/\d+ "),
    )
    plain = Side(
        "plain",
        cli.torchrun_command(nproc, PLAIN_LOOP, "--steps", "1"),
        re.compile(r'^\{"samples_per_sec"', re.MULTILINE),
    )
    return ours, plain


def parse_args() -> argparse.Namespace:
    parser = cli.parser(__doc__)
    cli.add_repeats(parser, 3, "starts of each side, alternating")
    cli.add_nproc(parser, "trainer processes, as the main job's -j 1x2")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a start may take to reach step 1")
    cli.add_json(parser)
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as folder:
        ours, plain = sides(opts.nproc, os.path.join(folder, "runs"))
        seconds: dict[str, list[float]] = {ours.name: [], plain.name: []}
        for repeat in range(opts.repeats):
            for side in (ours, plain) if repeat % 2 == 0 else (plain, ours):
                log = os.path.join(folder, f"{side.name}-{repeat}.log")
                seconds[side.name].append(side.time_to_first_step(log, opts.timeout))
                print(f"repeat {repeat}: {side.name} reached step 1 in {seconds[side.name][-1]:.2f} s", flush=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    report = {
        "nproc": opts.nproc,
        "repeats": opts.repeats,
        "ours_s": median["ours"],
        "plain_s": median["plain"],
        "ratio": median["ours"] / median["plain"],
        "samples": seconds,
    }
    print(
        f"time to step 1, {opts.nproc} ranks, medians of {opts.repeats}: torchx run -s local_cwd "
        f"components.dlrm:train {report['ours_s']:.2f} s vs plain torchrun {report['plain_s']:.2f} s "
        f"= {report['ratio']:.2f} (target <= 1.2)"
    )
    cli.write_report(opts.json, report)


if __name__ == "__main__":
    main()
