"""Loading a checkpoint's shards: the collective call, with the reader that suits the location
and a planner that runs nothing from the files.

A load's damage found on any rank is raised on every rank as that damage
(:class:`apps.core.checkpoint.storage.errors.DamagedCheckpoint`), so that the checkpointer falls
back to the checkpoint before it.
"""

import io
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from apps.core.checkpoint.storage.batched_reader import BatchedFsspecReader
from apps.core.checkpoint.storage.checksums import Checksums
from apps.core.checkpoint.storage.entries import load_plain_data
from apps.core.checkpoint.storage.errors import DamagedCheckpoint
from apps.core.checkpoint.storage.reader import CheckpointReader


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte entries (non-tensor values) load with
    ``torch.load(weights_only=True)``: DCP's own ``weights_only=False`` would run whatever a
    planted shard file pickled. Our checkpoints hold tensors only; plain data still loads."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_plain_data(value, read_item.dest_index.fqn)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)


def load_shards(
    state: dict[str, Any],
    url: str,
    local: bool,
    checksums: Checksums | None,
    metadata: dcp_metadata.Metadata | None = None,
) -> None:
    """Collective: every rank reads into ``state`` the pieces it holds under its current sharding,
    checked against ``checksums`` (None: unchecked); ``metadata``: the checkpoint's ``.metadata``
    where this rank has read it already (:meth:`CheckpointReader.read_metadata`). Raises
    :class:`DamagedCheckpoint` on every rank where a rank found the checkpoint damaged."""
    # A local file is read in place; an object store's in large batches of requests.
    reader = (CheckpointReader if local else BatchedFsspecReader)(url, checksums, metadata)
    try:
        dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner())
    except CheckpointException as e:  # every rank's errors, on every rank
        damage = next((error for error, _ in e.failures.values() if isinstance(error, DamagedCheckpoint)), None)
        if damage is None:
            raise
        raise damage from None
