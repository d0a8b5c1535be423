"""How long a run trains and how often it validates: :class:`RunLength`, fixed once the data is open.

Finite data (Criteo, Parquet) trains ``--epochs`` passes over its training rows, as TorchRec's
``dlrm_main`` does (one by default), and ``--steps``, when given, stops it earlier. Synthetic data
never repeats, so it has no epochs: it trains ``--steps`` (1500 when not given). A run validates
every ``--val_every_steps``, by default after every epoch, and always after its last step
(:class:`apps.core.training.validations.Validations` decides each step).
"""

from dataclasses import dataclass

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections


@dataclass(frozen=True)
class RunLength:
    steps: int  #: training steps in all
    steps_per_epoch: int | None  #: None: data without epochs (synthetic)
    val_every: int  #: validate after every this many steps (0: only after the last)

    @classmethod
    def of(cls, cfg: SharedSections, steps_per_epoch: int | None) -> "RunLength":
        """The run's length from its options and its data's epoch; refuses a validation interval
        longer than the run, which would never validate before the end."""
        training, evaluation = cfg.training, cfg.evaluation
        if steps_per_epoch is None:
            steps = training.steps or training.synthetic_steps
        else:
            steps = training.epochs * steps_per_epoch
            if training.steps:
                steps = min(steps, training.steps)
        val_every = evaluation.val_every_steps or steps_per_epoch or 0
        if evaluation.val_every_steps > steps:
            raise ConfigError(
                f"--val_every_steps {evaluation.val_every_steps} is more than the run's {steps} steps: "
                f"it would validate only at the end; give at most {steps}, or 0 (after every epoch)"
            )
        return cls(steps, steps_per_epoch, val_every if val_every < steps else 0)

    def epochs(self, step: int) -> float:
        """Epochs trained after ``step`` steps (None-safe: 0 for data without epochs)."""
        return step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def describe(self, global_batch: int) -> str:
        """The line the log starts training with."""
        if self.steps_per_epoch is None:
            return f"{self.steps} steps of {global_batch} samples (synthetic data has no epochs)"
        epochs = self.epochs(self.steps)
        return (
            f"{self.steps} steps of {global_batch} samples: an epoch is {self.steps_per_epoch} steps, "
            f"so {epochs:g} epoch{'s' if epochs != 1 else ''}"
        )
