"""How long a run trains, when it validates and when it stops early: epochs of finite data,
--steps as a cap, learning-rate shapes as fractions of the run, and the validations' record."""

import math

import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.core.training.optim import LRShape, lr_scale
from apps.core.training.run_length import RunLength
from apps.core.training.validations import Validations
from apps.dlrm.config import train_config
from apps.hstu.config import train_config as hstu_train_config

# Tier (tests/conftest.py): pure logic in this process.
TIER = "unit"

PARQUET = dict(data="parquet", data_path="/data/clicks")


def validated_steps(cfg, steps_per_epoch: int | None) -> list[int]:
    """The steps a run of ``cfg`` validates after, on data of ``steps_per_epoch``."""
    run = RunLength.of(cfg, steps_per_epoch)
    validations = Validations.of(cfg.evaluation, run)
    return [step for step in range(1, run.steps + 1) if validations.due(step)]


def test_finite_data_trains_one_epoch_by_default_and_validates_after_each():
    run = RunLength.of(train_config(**PARQUET), steps_per_epoch=117)
    assert (run.steps, run.val_every) == (117, 0)  # one epoch: validated once, at its end
    assert validated_steps(train_config(**PARQUET), 117) == [117]
    assert run.describe(1024) == "117 steps of 1024 samples: an epoch is 117 steps, so 1 epoch"
    assert validated_steps(train_config(**PARQUET, epochs=3), 117) == [117, 234, 351]


def test_steps_cap_the_epochs_and_synthetic_data_keeps_its_step_default():
    assert RunLength.of(train_config(**PARQUET, epochs=20, steps=500), steps_per_epoch=117).steps == 500
    assert RunLength.of(train_config(**PARQUET, steps=50), steps_per_epoch=117).steps == 50
    synthetic = RunLength.of(train_config(), steps_per_epoch=None)
    assert (synthetic.steps, synthetic.val_every, synthetic.epochs(1500)) == (1500, 0, 0.0)
    assert validated_steps(train_config(val_every_steps=100), None) == list(range(100, 1501, 100))


@pytest.mark.parametrize(
    "options, steps_per_epoch, fragment",
    [
        (dict(**PARQUET, epochs=0), 117, "--epochs 0 must be positive"),
        (dict(epochs=3), None, "--epochs 3: synthetic data never repeats, so it has no epochs; give --steps"),
        (dict(**PARQUET, val_every_steps=500), 117, "--val_every_steps 500 is more than the run's 117 steps"),
        (dict(early_stopping_patience=2), None, "needs validations during training, but synthetic data"),
        (dict(lr_warmup_fraction=0.1, lr_warmup_steps=10), None, "both shape the learning rate"),
        (dict(lr_warmup_fraction=0.6, lr_decay_fraction=0.6), None, "add up to more than the run"),
        (dict(lr_decay_fraction=1.5), None, "--lr_decay_fraction 1.5 must be in [0, 1)"),
    ],
)
def test_bad_run_lengths_are_refused_before_step_one(options, steps_per_epoch, fragment):
    with pytest.raises(ConfigError) as error:
        RunLength.of(train_config(**options), steps_per_epoch)
    assert fragment in str(error.value)


@pytest.mark.parametrize("app_config", [train_config, hstu_train_config], ids=["dlrm", "hstu"])
@pytest.mark.parametrize("name", ["val_batches", "test_batches"])
def test_evaluation_batches_0_the_whole_split_is_refused_on_synthetic_data_that_has_no_end(app_config, name):
    with pytest.raises(ConfigError) as error:
        app_config(**{name: 0})
    assert str(error.value) == (
        f"--{name} 0 means the whole split, but synthetic data's splits have no end: give a number of batches, "
        f"e.g. --{name} 40"
    )
    assert getattr(app_config(**PARQUET, **{name: 0}).evaluation, name) == 0  # finite data: its whole split


def test_warmup_and_decay_as_fractions_of_the_run():
    shape = LRShape.of(train_config(**PARQUET, lr_warmup_fraction=0.1, lr_decay_fraction=0.2).training, 1000)
    assert shape == LRShape(warmup_steps=100, decay_start=800, decay_steps=200)
    assert lr_scale(shape, 0) == pytest.approx(0.01) and lr_scale(shape, 99) == 1.0
    assert lr_scale(shape, 500) == 1.0 and lr_scale(shape, 800) == 1.0
    assert lr_scale(shape, 999) == pytest.approx((1 / 200) ** 2)
    steps = LRShape.of(train_config(lr_warmup_steps=5, lr_decay_start=10, lr_decay_steps=4).training, 1000)
    assert steps == LRShape(5, 10, 4)  # given in steps: as before, whatever the run's length


def test_early_stopping_counts_validations_without_improvement_and_resumes_its_count():
    cfg = train_config(**PARQUET, early_stopping_patience=2, early_stopping_min_delta=0.01).evaluation
    validations = Validations.of(cfg, RunLength(1000, 10, 10))
    assert validations.add(10, {"auroc": 0.70, "log_loss": 0.60})
    assert validations.add(20, {"auroc": 0.72, "log_loss": 0.58})
    assert not validations.add(30, {"auroc": 0.725, "log_loss": 0.57})  # +0.005 < min_delta
    assert not validations.stopped_early
    resumed = Validations.of(cfg, RunLength(1000, 10, 10))
    resumed.resume(validations.record())  # what a checkpoint's manifest carries
    assert (resumed.best_step, resumed.since_best) == (20, 1)
    assert not resumed.add(40, {"auroc": 0.71, "log_loss": 0.62})
    assert resumed.stopped_early and resumed.best_step == 20 and resumed.best == {"auroc": 0.72, "log_loss": 0.58}


def test_log_loss_improves_downwards():
    validations = Validations.of(
        train_config(**PARQUET, early_stopping_metric="log_loss").evaluation, RunLength(3, 1, 1)
    )
    assert validations.add(1, {"auroc": 0.7, "log_loss": 0.5})
    assert not validations.add(2, {"auroc": 0.8, "log_loss": 0.6})
    assert validations.add(3, {"auroc": 0.6, "log_loss": 0.4}) and validations.best_step == 3


def test_an_undefined_metric_is_never_best_nor_counted_against_the_patience():
    """AUROC on a validation split of one class is NaN (ClickMetrics): not a best, not a miss."""
    validations = Validations.of(train_config(**PARQUET, early_stopping_patience=1).evaluation, RunLength(3, 1, 1))
    for step in (1, 2, 3):
        assert not validations.add(step, {"auroc": math.nan, "log_loss": 0.5})
    assert validations.best_step is None and not validations.stopped_early


def test_auroc_of_a_split_of_one_class_is_undefined():
    from torchrec.datasets.utils import Batch

    from apps.dlrm.training.metrics import ClickMetrics

    logits = torch.linspace(-2, 2, 8)
    for labels, defined in ((torch.zeros(8), False), (torch.ones(8), False), (torch.tensor([0.0, 1.0] * 4), True)):
        metrics = ClickMetrics(torch.device("cpu"), teacher=lambda batch: logits)
        metrics.update(Batch(torch.zeros(8, 1), None, labels), (None, logits, labels))  # type: ignore[arg-type]
        results = metrics.compute()
        assert math.isnan(results["auroc"]) != defined and math.isnan(results["auroc_ceiling"]) != defined
        assert results["log_loss"] > 0
