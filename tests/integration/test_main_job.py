"""The README's main job, as a user runs it: two trainers through `torchx run -s local_cwd`."""

import json
import os
import re

from apps.core.config import SYNTHETIC_STEPS
from apps.dlrm.training.app import CEILING_NOTE
from tests.conftest import LOCAL_TRAIN_1X2, REPO, assert_ok, run

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"


#: What a successful job's output must not show (issue 23): torchrun's OMP_NUM_THREADS banner,
#: TorchX's notices, and a progress bar's redraws glued to log lines.
NOISE = (
    "OMP_NUM_THREADS",
    "tracker configurations",
    "Log directory not set",
    "log directory is",
    "%|",
    "step/s",
    "\r",
)


def test_main_job_trains_a_sharded_dlrm_that_learns(tmp_path):
    out = tmp_path / "outputs"
    result = run(
        [
            *LOCAL_TRAIN_1X2,
            "--output_dir",
            str(out),
        ],
        cwd=str(tmp_path),  # any directory: the component and app come from the installed project
        OMP_NUM_THREADS=None,  # as a user runs it: the trainers' threads are the job's to set
    )
    assert_ok(result)
    assert_quiet(result.stdout + result.stderr, result.stderr, out)
    assert_readme_example_is_true(job_lines(result.stderr), out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == SYNTHETIC_STEPS == 1500  # synthetic data has no epochs
    # The defaults learn the hidden teacher to within 0.05 AUROC of the best possible.
    ceiling = summary["auroc_ceiling"]
    assert 0.75 < ceiling < 0.9
    assert summary["val_auroc"] >= ceiling - 0.05, summary
    assert summary["test_auroc"] >= ceiling - 0.05, summary
    assert summary["final_train_loss"] < 0.6
    assert summary["samples_per_sec"] > 0
    # the tables really were split over both ranks
    ranks = {line.rsplit(" ", 1)[-1] for line in summary["sharding_plan"]}
    assert {"0", "1"} <= set(",".join(ranks).split(","))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))


def assert_quiet(output: str, log: str, out) -> None:
    """The job's output is its own lines: no noise, the sharding plan in one line (the whole plan
    in the run's plan.txt), the ceiling explained once beside the first validation that shows
    it, and last, where the results are. ``log``: the job's lines in order (torchx's stderr)."""
    assert not [noise for noise in NOISE if noise in output], output[-5000:]
    lines = job_lines(log)
    assert [line for line in lines if "sharding plan" in line or "t_cat_" in line] == [
        f"sharding plan (auto): 26 tables (26 table_wise) on 2 ranks, 13 per rank; the whole plan: {out}/plan.txt"
    ]
    assert len((out / "plan.txt").read_text().splitlines()) == 26
    noted = [i for i, line in enumerate(lines) if line == CEILING_NOTE]
    assert len(noted) == 1 and "auroc_ceiling" in lines[noted[0] - 1], lines
    assert lines[-3:] == [
        f"summary: {out}/summary.json",
        f"curves: {out}/curves.png",
        f"TensorBoard: tensorboard --logdir {out}",
    ]
    assert (out / "curves.png").is_file()


def job_lines(log: str) -> list[str]:
    """The trainers' log lines in ``log`` (torchx's stderr), without their prefixes."""
    return [line.split(" INFO ", 1)[-1] for line in log.splitlines() if line.startswith("train/0 ")]


#: A figure in the output: compared within EXAMPLE_TOLERANCE (kernels differ between CPUs).
FIGURE = re.compile(r"\d+\.\d+")
EXAMPLE_TOLERANCE = 0.005


def readme_example() -> list[str]:
    """The example output of the README's quick start: the fenced block after its 'It ends with
    these lines'."""
    with open(os.path.join(REPO, "README.md")) as f:
        after = f.read().split("It ends with these lines", 1)[1]
    return after.split("```\n", 2)[1].splitlines()


def assert_readme_example_is_true(lines: list[str], out) -> None:
    """The README's example is the job's last lines: the same text, every figure within
    EXAMPLE_TOLERANCE of the job's (the AUROC ceiling, a property of the data, exactly)."""
    example = [line.replace("outputs/dlrm-<id>", str(out)) for line in readme_example()]
    assert len(example) == 6
    for want, got in zip(example, lines[-len(example) :]):
        assert FIGURE.sub("#", want) == FIGURE.sub("#", got), (want, got)
        for a, b in zip(FIGURE.findall(want), FIGURE.findall(got)):
            assert abs(float(a) - float(b)) <= EXAMPLE_TOLERANCE, (want, got)
    ceiling = re.compile(r"auroc_ceiling (\S+)")
    assert ceiling.search(example[0]).group(1) == ceiling.search(lines[-6]).group(1)
