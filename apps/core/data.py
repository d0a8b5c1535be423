"""What every app's data shares: the :class:`DataSource` protocol the Trainer reads batches
through, and :class:`RankShare`, where one rank reads.

Torch-free on purpose: an app's data package imports this module when its configuration is
read (the DLRM's config reads the Criteo tables), and that must not load torch. Each app's
sources take their own model and data sections and a :class:`RankShare`, never the whole
configuration; the app's ``make_data`` is the one place that takes it apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Protocol, TypeVar

if TYPE_CHECKING:
    from apps.core.config import TrainingConfig

#: The batches of a source: a TorchRec ``Pipelineable`` that the app's model takes.
BatchT = TypeVar("BatchT", covariant=True)


@dataclass(frozen=True)
class RankShare:
    """Where one rank reads: its share (rank ``rank`` of ``world_size``) of every global batch of
    ``world_size * batch_size`` samples, in the order ``seed`` draws. A batch is a pure function
    of these and the step, which is what makes a resumed run read the batches of an
    uninterrupted one."""

    rank: int
    world_size: int
    seed: int
    batch_size: int

    @classmethod
    def of(cls, training: TrainingConfig, rank: int = 0, world_size: int = 1) -> RankShare:
        """Rank ``rank`` of ``world_size``'s share under the training section's seed and batch size."""
        return cls(rank, world_size, training.seed, training.batch_size)

    @property
    def global_batch(self) -> int:
        """Samples of one step over all ranks."""
        return self.batch_size * self.world_size

    def block(self, index: int) -> int:
        """Of data dealt in blocks of ``batch_size`` samples, the block this rank reads of global
        batch ``index``: ranks take consecutive blocks, so one process reading blocks
        ``index * world_size ...`` in turn sees the global batch whole."""
        return index * self.world_size + self.rank


class DataSource(Protocol[BatchT]):
    """A run's data: one rank's batches, each a pure function of (seed, step, rank), so that a
    resumed run reads exactly the batches an uninterrupted one reads. A batch is a TorchRec
    ``Pipelineable`` (it moves to the device as the pipeline needs) that the model's forward takes.
    An app's sources extend it with what is their own (the DLRM's ``ClickLogs`` adds its teacher)."""

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of one pass over the training rows; None for data that never repeats (synthetic)."""
        ...

    @property
    def columns(self) -> dict[str, Any] | None:
        """The columns the model reads, as matched in the data (names in feature order, and
        kinds), which a checkpoint's manifest records for serving to check data against; None
        where the options alone fix them."""
        ...

    def train_batches(self, start_step: int = 0) -> Generator[BatchT, None, None]:
        """This rank's training batches from ``start_step`` on, without end."""
        ...

    def eval_batches(self, split: str, num_batches: int) -> Generator[BatchT, None, None]:
        """This rank's batches of ``split`` ("val" or "test"), as many on every rank."""
        ...
