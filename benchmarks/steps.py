"""One training step of the app's Trainer or of the plain TorchRec loop, as a call, for the
benchmarks that time steps themselves (step_overhead.py, train_throughput.py's steady rows).

Each runs in a rank under torchrun. Its batches are made in the loop, each when the step takes it
(as in training: the synthetic data's teacher runs on the rank's device), or, ``pool``, made
before the first step and cycled, so that making them is no step's cost.
"""

import itertools
from typing import Any, Callable, Iterator

#: Batches made before the timed steps, cycled.
POOL = 64


def pooled(batches: Iterator[Any]) -> Iterator[Any]:
    """:data:`POOL` batches of ``batches``, made now, then cycled without end."""
    return itertools.cycle([next(batches) for _ in range(POOL)])


def app_step(app_args: list[str], pool: bool) -> tuple[Callable[[], Any], str]:
    """The app Trainer's step (returning its loss) and which step it is (:func:`step_taken`)."""
    from apps.core.common.distributed import init_distributed
    from apps.dlrm.config import parse_train_config
    from apps.dlrm.training.app import Trainer

    trainer = Trainer(parse_train_config([*app_args, "--output_dir", ""]), init_distributed())
    batches = trainer.data.train_batches()
    if pool:
        batches = pooled(batches)
    return (lambda: trainer.train_step(batches)), step_taken(trainer)


def step_taken(trainer: Any) -> str:
    """``sharded``, ``lean``, or ``lean graph`` (the lean step replayed as one CUDA graph: the
    Trainer's ``not_graph``, why not, is empty; a Trainer without a step graph has none)."""
    if trainer.not_lean:
        return "sharded"
    return "lean" if getattr(trainer, "not_graph", "no step graph") else "lean graph"


def plain_step(app_args: list[str], pool: bool) -> Callable[[], Any]:
    """plain_torchrec_loop.py's pipeline step (returning its loss) on the app's synthetic batches."""
    from apps.core.data import RankShare
    from apps.dlrm.config import parse_train_config
    from apps.dlrm.data.synthetic import SyntheticClickLogs
    from benchmarks.plain_torchrec_loop import plain_pipeline, start

    cfg = parse_train_config(app_args)
    device, rank, world = start(cfg)
    pipeline = plain_pipeline(cfg, device)
    share = RankShare.of(cfg.training, rank, world)
    batches: Iterator[Any] = SyntheticClickLogs(cfg.model, cfg.data, share, device).train_batches()
    if pool:
        batches = pooled(batches)
    return lambda: pipeline.progress(batches)[0]
