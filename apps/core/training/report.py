"""What a run tells its user: log lines, a progress bar on a terminal, TensorBoard scalars,
summary.json and the other files of its folder, and at its end where they are.

Only rank 0 reports; the other ranks get a reporter that stays silent.
"""

import json
import logging
import math
import os
import shlex
import sys
import uuid
from typing import Any

from tqdm import tqdm

from apps.core.urls import redact_urls

logger = logging.getLogger(__name__)

#: The run's results: its figures, the sharding plan and the config (written once, at the end).
SUMMARY_FILE = "summary.json"
#: The run's metrics, one JSON object per line (kind: train, val or test; step; the values).
METRICS_FILE = "metrics.jsonl"
#: The run's curves drawn from METRICS_FILE at its end: training loss and the app's validation metrics.
CURVES_FILE = "curves.png"
#: The run's sharding plan, one line per table (the log has it in one line).
PLAN_FILE = "plan.txt"


def to_json(values: dict[str, Any], indent: int | None = None) -> str:
    """``values`` as JSON, a value that is no finite number (a loss never measured, a metric
    undefined on a split of one class) as null: Python's NaN is not JSON, and readers refuse it."""
    return json.dumps(_finite(values), indent=indent, sort_keys=True, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


class _ProgressBar(tqdm):
    """tqdm without its monitor thread, which tqdm starts with the first bar and never stops:
    no thread of the app may outlive training (see apps/dlrm/data/prefetch.py)."""

    monitor_interval = 0


# Library loggers that speak of their internals at every run (the known-harmless warnings are
# filtered in apps/core/common/library_warnings.py).
_LIBRARY_LOGGERS = ("torch.fx._symbolic_trace",)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(super().format(record))


def redacting_handler(fmt: str) -> logging.Handler:
    """A handler of log lines to stderr that hides the credentials of URLs in every line, ours
    and the libraries', tracebacks included: a URL option given with user info
    (``s3://KEY:SECRET@bucket``) must not end up in a job's log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter(fmt, datefmt="%H:%M:%S"))
    return handler


def setup_logging(rank: int) -> None:
    """Our INFO lines on rank 0; only warnings from libraries and other ranks."""
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.basicConfig(
        level=logging.WARNING,
        handlers=[redacting_handler(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")],
        force=True,  # libraries imported before us may have configured the root logger
    )
    logging.getLogger("apps").setLevel(logging.INFO if rank == 0 else logging.WARNING)


class Reporter:
    """Rank 0's log lines, progress bar, TensorBoard event files and the run folder's files."""

    def __init__(self, output_dir: str, enabled: bool) -> None:
        self.output_dir = output_dir
        self.enabled = enabled
        self._writer: Any = None  # a SummaryWriter, made on first use (scalars)
        self._bar: _ProgressBar | None = None
        self._noted: set[str] = set()
        self._curves: str | None = None  # curves.png, once drawn

    def progress(self, total: int, initial: int) -> None:
        """Starts the training progress bar, on a terminal only. In a log (torchx, a scheduler)
        a bar is fragments: each redraw starts with a carriage return, which log readers take
        for a line break, and ends without one, so the next log line is glued to it. There the
        step lines (--log_every) say the progress."""
        if not (self.enabled and sys.stderr.isatty()):
            return
        self._bar = _ProgressBar(
            total=total,
            initial=initial,
            unit="step",
            desc="train",
            mininterval=0.5,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def step(self, **postfix: float) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self._bar.update(1)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """Adds ``values`` to the TensorBoard event file, which the first call makes: a run that
        reports nothing (nothing left to do) leaves no tensorboard/ folder."""
        if not (self.enabled and self.output_dir):
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=os.path.join(self.output_dir, "tensorboard"))
        for name, value in values.items():
            self._writer.add_scalar(f"{prefix}/{name}", value, step)
        self._writer.flush()

    def record(self, kind: str, step: int, values: dict[str, float]) -> None:
        """Appends ``values`` (a training window, a validation, the test) as one JSON line to
        metrics.jsonl, beside summary.json: the run's curve for any tool, TensorBoard or not."""
        if self.enabled and self.output_dir:
            with open(os.path.join(self.output_dir, METRICS_FILE), "a") as f:
                f.write(to_json({"kind": kind, "step": step, **values}) + "\n")

    def draw_curves(self, val_curves: tuple[tuple[str, str], ...]) -> str | None:
        """Draws metrics.jsonl's training loss and the validation metrics of ``val_curves``
        ((metric, title) each: the app's) against the step into curves.png, for users on a
        cluster without TensorBoard; returns its path. A run that finished is never failed by
        its curves: where they cannot be written (a full disk, a read-only folder) the run warns
        in one line naming the path and returns None."""
        if not (self.enabled and self.output_dir):
            return None
        path = os.path.join(self.output_dir, CURVES_FILE)
        try:
            self._curves = self._draw(val_curves, path)
        except OSError as e:
            logger.warning("could not draw %s (%s): the run's figures are in %s", path, _reason(e), SUMMARY_FILE)
        return self._curves

    def _draw(self, val_curves: tuple[tuple[str, str], ...], path: str) -> str:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, no GUI toolkit
        from matplotlib import pyplot

        with open(os.path.join(self.output_dir, METRICS_FILE)) as f:
            metrics = [json.loads(line) for line in f]
        panels = (("train", "loss", "training loss"), *(("val", name, title) for name, title in val_curves))
        figure, axes = pyplot.subplots(1, len(panels), figsize=(13, 3.6), sharex=True)
        for axis, (kind, name, title) in zip(axes, panels):
            points = [(m["step"], m[name]) for m in metrics if m["kind"] == kind and m.get(name) is not None]
            if points:
                axis.plot(*zip(*points), marker="o" if kind == "val" else None, markersize=3)
            axis.set_title(title)
            axis.set_xlabel("step")
            axis.grid(alpha=0.3)
        figure.tight_layout()
        try:
            figure.savefig(path, dpi=100)
        finally:
            pyplot.close(figure)
        return path

    def log(self, message: str, *args: Any) -> None:
        if not self.enabled:
            return
        if self._bar is not None:  # cleared around the line, redrawn under it
            self._bar.clear()
        logger.info(message, *args)
        if self._bar is not None:
            self._bar.refresh()

    def note(self, message: str) -> None:
        """Logs ``message`` the first time only: what a term in the log means, beside its first use."""
        if message not in self._noted:
            self._noted.add(message)
            self.log("%s", message)

    def log_results(self) -> None:
        """The run's last lines: where its results are, and the command that shows its curves
        in TensorBoard (which finds the event files under the run's folder)."""
        if self.enabled and self.output_dir:
            self.log("summary: %s", os.path.join(self.output_dir, SUMMARY_FILE))
            if self._curves:
                self.log("curves: %s", self._curves)
            # Quoted: the line is a command to paste into a shell, and a folder may hold spaces or $.
            self.log("TensorBoard: tensorboard --logdir %s", shlex.quote(self.output_dir))

    def write_summary(self, summary: dict[str, Any]) -> str | None:
        """Writes summary.json; returns its path (None where this reporter writes nothing)."""
        return self.write_file(SUMMARY_FILE, to_json(summary, indent=2) + "\n")

    def write_file(self, name: str, text: str) -> str | None:
        """Writes the run folder's file ``name`` atomically (a reader never sees half a file);
        returns its path (None where this reporter writes nothing).

        The temporary file has a new, unique name in the same folder, created exclusively: a
        file or symlink someone left at a predictable name is never followed or overwritten,
        and two runs sharing --output_dir never write into each other's temporary file.
        """
        if not (self.enabled and self.output_dir):
            return None
        path = os.path.join(self.output_dir, name)
        tmp = os.path.join(self.output_dir, f".{name}.{uuid.uuid4().hex}.tmp")
        # O_EXCL: fails on anything already there, a symlink included. Mode 0666 less the
        # umask, as a plain open() would give the file (mkstemp's would be 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)
        return path

    def close(self) -> None:
        self.close_progress()
        if self._writer is not None:
            self._writer.close()
