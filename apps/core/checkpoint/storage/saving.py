"""Saving a checkpoint's shards: the collective calls, now or in the background.

These run DCP's save with the checkpoint writer and planner
(:mod:`apps.core.checkpoint.storage.writer`) and say a full disk in one line
(:class:`apps.core.checkpoint.storage.errors.SaveFailed`); the folder
(:mod:`apps.core.checkpoint.folder`) calls them and commits what they wrote.
"""

from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from apps.core.checkpoint.storage.checksums import Checksums
from apps.core.checkpoint.storage.writer import CheckpointSavePlanner, CheckpointWriter


def save_shards(state: dict[str, Any], url: str, local: bool) -> Checksums | None:
    """Collective: every rank writes its shards of ``state`` under ``url``; returns once rank 0
    has written ``.metadata`` (so every rank's shards are complete), with the checksums of
    every rank's files on rank 0 (None elsewhere). ``local`` files are fsync'ed: a checkpoint is
    committed only after its bytes are on disk. Raises :class:`SaveFailed` on every rank where
    one ran out of space."""
    writer = CheckpointWriter(url, sync_files=local)
    try:
        dcp.save(state, storage_writer=writer, planner=CheckpointSavePlanner())
    except CheckpointException as e:  # every rank's errors, on every rank
        raise writer.explained(e) from None
    return writer.checksums


class HostStager(BlockingAsyncStager):
    """Copies the state to host memory for :func:`save_shards_async`, into buffers made at the
    first save and reused by every later one: the copy is then all a background save costs
    training (DCP's own stager allocates, and deep-copies sharded tensors, at every save, or
    caches only pinned buffers, which CPU-only machines cannot make). ``pinned`` (GPU ranks)
    page-locks them, so the copy from the GPU runs at full speed. One save at a time may use it
    (the buffers are what the writer reads); close it after the last."""

    def __init__(self, pinned: bool) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._pinned = pinned

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self._pinned)
        return _copy_state_dict(state_dict, self.state_dict_cache)


def save_shards_async(
    state: dict[str, Any],
    url: str,
    local: bool,
    group: dist.ProcessGroup,
    stager: HostStager,
    then: Callable[[Checksums | None], Any],
) -> ConcurrentFuture:
    """Collective: copies this rank's shards of ``state`` to host memory with ``stager`` now,
    then writes them in a background thread that coordinates over ``group``. Once rank 0 wrote
    ``.metadata`` (every rank's shards are then complete), that thread calls ``then`` with what
    :func:`save_shards` returns; the future gives what ``then`` returns, or raises what went
    wrong (running out of space: :class:`SaveFailed`). ``group`` must be a gloo group that nothing
    else uses, since its collectives run in that thread while training uses the default group."""
    writer = CheckpointWriter(url, sync_files=local)
    written = dcp.async_save(
        state, storage_writer=writer, planner=CheckpointSavePlanner(), process_group=group, async_stager=stager
    )
    # DCP returns an AsyncSaveResponse only for a stager that stages in the background.
    assert isinstance(written, ConcurrentFuture), "HostStager stages before async_save returns"
    done: ConcurrentFuture = ConcurrentFuture()

    def finish(saved: ConcurrentFuture) -> None:  # in DCP's writer thread
        try:
            saved.result()
            done.set_result(then(writer.checksums))
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; re-raised by result()
            done.set_exception(writer.explained(e))

    written.add_done_callback(finish)
    return done
