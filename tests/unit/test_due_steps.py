"""Which steps of a run save a checkpoint, validate and log a line, each decided by its owner
(the checkpointer's :class:`SaveSchedule`, the :class:`Validations`, the :class:`TrainingLog`),
and the loss guard that the log keeps."""

import logging
import math

import pytest
import torch
import torch.distributed as dist

from apps.core.checkpoint.checkpointer import SaveSchedule, TrainState
from apps.core.common.distributed import DistEnv, free_port
from apps.core.training.report import Reporter
from apps.core.training.run_length import RunLength
from apps.core.training.train_log import TrainingDiverged, TrainingLog
from apps.core.training.validations import Validations
from apps.dlrm.config import train_config

# Tier (tests/conftest.py): pure logic in this process (a gloo world of one for the log's all-reduces).
TIER = "unit"


def saved_steps(schedule: SaveSchedule, kept: tuple[int, ...] = ()) -> list[int]:
    return [step for step in range(1, schedule.last_step + 1) if schedule.due(step, keep=step in kept)]


def test_a_run_saves_every_interval_and_its_last_step_even_off_the_interval():
    assert saved_steps(SaveSchedule(every=10, last_step=25)) == [10, 20, 25]
    assert saved_steps(SaveSchedule(every=0, last_step=25)) == [25]  # --checkpoint_every 0: the last only


def test_a_run_saves_the_model_its_validations_keep_between_intervals():
    assert saved_steps(SaveSchedule(every=10, last_step=25), kept=(7, 20)) == [7, 10, 20, 25]


def validations(patience: int = 0) -> Validations:
    cfg = train_config(data="parquet", data_path="/data/clicks", early_stopping_patience=patience).evaluation
    return Validations.of(cfg, RunLength(steps=25, steps_per_epoch=10, val_every=10))


def test_a_run_validates_every_interval_and_after_its_last_step():
    due = validations()
    assert [step for step in range(1, 26) if due.due(step)] == [10, 20, 25]


def test_the_validations_keep_the_best_model_and_the_last_before_stopping_early():
    run = validations(patience=2)
    run.add(10, {"auroc": 0.70, "log_loss": 0.6})
    assert run.keeps(10) and run.verdict(10) == "the best so far"
    run.add(20, {"auroc": 0.69, "log_loss": 0.6})
    assert not run.keeps(20) and run.verdict(20) == "no better than step 10's (1 of 2)"
    run.add(25, {"auroc": 0.68, "log_loss": 0.6})
    assert run.keeps(25) and run.stopped_early  # the model training stops with is kept too
    assert run.stopping(25) == (
        "stopping early after step 25: 2 validations without an improvement of 0 in auroc; the best was step 10"
    )
    assert run.latest == {"auroc": 0.68, "log_loss": 0.6}  # the summary's last validation


def test_a_validation_whose_metric_is_undefined_says_why_and_how_to_define_it():
    run = validations()
    run.add(10, {"auroc": math.nan, "log_loss": 0.6})
    assert not run.keeps(10)
    assert run.verdict(10).startswith("auroc is undefined on this split, which holds one class")


@pytest.fixture(scope="module")
def env():
    """This process as a world of one rank: the log all-reduces its losses over the ranks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


def train(env: DistEnv, losses: dict[int, float], saved: tuple[int, ...] = (), validated: tuple[int, ...] = ()):
    """Hands the log ``losses`` (step: loss, from step 1) of a run of 10 steps logging every 4."""
    state = TrainState(0)
    log = TrainingLog(Reporter("", enabled=True), env, state, every=4, last_step=10, global_batch=8)
    for step, loss in losses.items():
        state.step = step
        log.step(torch.tensor(loss), saved=step in saved, validated=step in validated)
    return log, state


def step_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The log's step lines without their throughput (which is timing)."""
    return [r.getMessage().rsplit("  ", 1)[0] for r in caplog.records if r.getMessage().startswith("step ")]


def test_the_log_writes_a_line_every_interval_on_the_last_step_and_where_a_checkpoint_is_saved(env, caplog):
    with caplog.at_level(logging.INFO, logger="apps"):
        log, state = train(env, {step: float(step) for step in range(1, 11)}, saved=(6,))
    assert step_lines(caplog) == [
        "step 4/10  loss 2.5000",  # the mean of the window's losses
        "step 6/10  loss 5.5000",  # a checkpoint's step: its loss is the checkpoint's
        "step 8/10  loss 7.5000",
        "step 10/10  loss 9.5000",
    ]
    assert state.train_loss == 10.0 and log.throughput.samples == 80


def test_a_run_that_stops_between_log_steps_logs_its_last_window(env, caplog):
    with caplog.at_level(logging.INFO, logger="apps"):
        log, state = train(env, {step: float(step) for step in range(1, 6)})
        log.end()
    assert step_lines(caplog) == ["step 4/10  loss 2.5000", "step 5/10  loss 5.0000"]
    assert state.train_loss == 5.0


def test_the_loss_guard_names_the_first_bad_step_at_the_next_log_step(env):
    with pytest.raises(TrainingDiverged) as error:
        train(env, {1: 1.0, 2: math.nan, 3: math.inf, 4: 1.0})
    assert str(error.value).startswith("step 2: the training loss is not finite (NaN or inf)")


def test_the_loss_guard_checks_before_a_validation_between_log_steps(env):
    """A validation may keep (save) its model: the losses up to it are checked first."""
    with pytest.raises(TrainingDiverged) as error:
        train(env, {1: 1.0, 2: 1.0, 3: math.inf}, validated=(3,))
    assert error.value.step == 3
    _, state = train(env, {1: 1.0, 2: 1.0, 3: math.inf})  # not validated: checked at step 4's line
    assert state.step == 3
