"""The training loop's log: :class:`TrainingLog` keeps the window of losses since the last log
line and the meters, writes a line every ``--log_every`` steps, and guards the loss.

Each step's loss stays on the device until a log step fetches the window's at once: the one
host sync training has. The log's lines, TensorBoard scalars and metrics.jsonl records of the
training loss all come from here; so does the run's ``train_loss`` that checkpoints keep.
"""

import torch
import torch.distributed as dist

from apps.core.checkpoint.checkpointer import TrainState
from apps.core.common.distributed import DistEnv, all_reduce_mean
from apps.core.common.errors import ConfigError
from apps.core.training.metrics import Stopwatch, Throughput
from apps.core.training.report import Reporter


class TrainingDiverged(ConfigError):
    """The training loss stopped being finite: the run ends with this one line (exit 2), having
    committed no checkpoint after the step it names. An error of the run's options or data."""

    def __init__(self, step: int) -> None:
        super().__init__(
            f"step {step}: the training loss is not finite (NaN or inf); training stopped without "
            "saving anything from that step on: lower --learning_rate and --dense_learning_rate, or "
            "scale the dense features (large values overflow)"
        )
        self.step = step


class TrainingLog:
    """The log of one training run's steps, from ``state.step`` to ``last_step``: hand it each
    step's loss (:meth:`step`), what the step is for (saved, validated), and the time that is
    not training (:meth:`pause`); :meth:`end` logs the last, partial window.

    ``throughput`` is the whole run's samples per second, ``window`` the losses (on the device)
    of the steps since the last log line; each log line makes its window's last loss the run's
    (``state.train_loss``)."""

    def __init__(
        self, reporter: Reporter, env: DistEnv, state: TrainState, every: int, last_step: int, global_batch: int
    ) -> None:
        self.reporter, self.env, self.state = reporter, env, state
        self.every, self.last_step, self.global_batch = every, last_step, global_batch
        self.throughput, self._meter = Throughput(), Throughput()  # the run's, the window's
        self.window: list[torch.Tensor] = []
        reporter.progress(total=last_step, initial=state.step)
        self._stopwatch = Stopwatch()

    def due(self, step: int, saved: bool) -> bool:
        """Whether ``step`` is a log step: every ``every``, the last, and any step whose checkpoint
        is ``saved`` on its schedule (its loss is checked and becomes the checkpoint's)."""
        return step % self.every == 0 or step == self.last_step or saved

    def step(self, loss: torch.Tensor, saved: bool, validated: bool) -> None:
        """Collective. Takes the loss (on the device) of the step ``state.step``, which is to be
        ``saved`` on the checkpoints' schedule and/or ``validated``; logs its window on a log step.

        Raises :class:`TrainingDiverged` where a loss is not finite (:meth:`check`): on a log
        step and before a validation, so that no model after a bad step is saved or validated."""
        self.window.append(loss)
        step = self.state.step
        logs = self.due(step, saved)
        if logs or validated:
            self.check()
        # On log steps only: it waits for the device to finish, so that the lap below times work
        # done, not work queued.
        losses = torch.stack(self.window).tolist() if logs else []
        elapsed = self._stopwatch.lap()
        self.throughput.add(elapsed, self.global_batch)
        self._meter.add(elapsed, self.global_batch)
        if logs:
            self.reporter.step(loss=self._log_window(losses))
        else:
            self.reporter.step()

    def pause(self) -> None:
        """The time since the last step (validation, checkpoint) is not training time."""
        self._stopwatch.lap()

    def end(self) -> None:
        """Collective. Training ended: logs the last window where it stopped (early) between
        log steps (its losses were checked before the validation that stopped it)."""
        if self.window:
            self._log_window(torch.stack(self.window).tolist())
        self.reporter.close_progress()

    def _log_window(self, losses: list[float]) -> float:
        """Collective. Reports the window that ends at this step (``losses``: this rank's, one
        per step), makes its last step's loss the run's and starts the next; returns its mean."""
        env, step, meter = self.env, self.state.step, self._meter
        self.state.train_loss = all_reduce_mean(losses[-1], env)
        window_loss = all_reduce_mean(sum(losses) / len(losses), env)
        train = {"loss": window_loss, "samples_per_sec": meter.samples_per_sec}
        self.reporter.scalars("train", train, step)
        self.reporter.record("train", step, train)
        self.reporter.log(
            "step %d/%d  loss %.4f  %.0f samples/s", step, self.last_step, window_loss, meter.samples_per_sec
        )
        self.window, self._meter = [], Throughput()
        return window_loss

    def check(self) -> None:
        """Collective. Raises :class:`TrainingDiverged` if the loss of any step of the window is
        not finite on any rank.

        A check per step would add a host sync per step (a GPU stall). So the window is checked
        where its losses are fetched anyway, and wherever else the run syncs before anything can
        be committed: every checkpoint on its schedule is taken on a log step, and the best
        model's (and early stopping's) after a validation, which is checked too. Every step is
        checked, every loss before its model is validated or saved, and every rank stops
        together (the first bad step is all-reduced). Its cost: one all-reduce of one number.
        """
        n = len(self.window)
        finite = torch.isfinite(torch.stack(self.window))
        first = torch.where(finite, n, torch.arange(n, device=finite.device)).min().reshape(1)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        bad = int(first.item())
        if bad < n:
            raise TrainingDiverged(self.state.step - n + 1 + bad)
