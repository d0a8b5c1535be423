"""The checkpoint writer: DCP's fsspec writer, laying shards out so that a rank reads few files,
checksumming every file as it is written, and keeping credentials out of ``.metadata``.

What is written, and how a write that ran out of space is said, are decided here; when and with
what state is :mod:`apps.core.checkpoint.storage.saving`'s.
"""

import dataclasses
import math
import os
import posixpath
import queue
from contextlib import contextmanager
from typing import Any, Iterator

from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from apps.core.checkpoint.storage.checksums import BlockSums, Checksums, FileChecksums
from apps.core.checkpoint.storage.errors import SaveFailed, no_space_left
from apps.core.urls import redact_urls

#: Shard files are checksummed in blocks of this many bytes, each a CRC-32 (a file's last block is
#: shorter). A load checks every block it reads a byte of, so a rank that reads some of a tensor's
#: rows (a resharded load) reads at most a block more at each end of them; 1 GB of shards has 256
#: checksums, ~3 KB of the manifest.
CHECKSUM_BLOCK_BYTES = 4 * 2**20


class _SummedStream:
    """A file being written, whose bytes :class:`BlockSums` sums as they pass: what DCP's writer
    uses of a stream (write, tell, flush, fileno for fsync, close). ``failed`` keeps the error a
    write raised: torch.save reports it as another one (``enforce fail ... unexpected pos``)."""

    def __init__(self, stream: Any, sums: BlockSums) -> None:
        self.stream, self.sums = stream, sums
        self.failed: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.stream.write(data)
        except OSError as e:
            self.failed = e
            raise
        with memoryview(data) as view, view.cast("B") as raw, raw[:written] as done:
            self.sums.add(done)
        return written

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def close(self) -> None:
        self.stream.close()


@dataclasses.dataclass(frozen=True)
class _WrittenFile:
    """A rank's shard file and its checksums, passed to rank 0 with the rank's DCP write results."""

    name: str
    checksums: FileChecksums


class CheckpointSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, the entries every rank holds (dense parameters, their optimizer
    state, the progress) all written by rank 0 (DCP would spread them over the ranks' files), in a
    file of their own (:meth:`CheckpointWriter.write_data`): a rank then reads its own shards and
    that small file. Each file read costs a request, which moto serves by reading the whole object:
    loads measured 0.65x of a raw read on it with DCP's layout."""

    def __init__(self) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)


class _SummedFiles(FsspecFileSystem):
    """DCP's fsspec file system, taking the checksums of every file written through it as it is
    written (:class:`_SummedStream`): :attr:`written` has them by file name."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, BlockSums] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """The stream; an error while it is written is raised as the write's own (no space
        left...), where the writer raised another on its account."""
        with super().create_stream(path, mode) as stream:
            summed = _SummedStream(stream, BlockSums(CHECKSUM_BLOCK_BYTES))
            self.written[os.path.basename(path)] = summed.sums
            try:
                yield summed
            except Exception as e:
                if summed.failed is None or summed.failed is e:
                    raise
                raise summed.failed from e


class _ServerSideRenames(_SummedFiles):
    """The checkpoint's file system on object stores, renaming objects by a server-side copy and a delete.

    DCP writes ``.metadata`` under a temporary name and renames it. On an object store a rename
    is a copy and a delete anyway, but gcsfs first asks for GCS's moveTo, which emulators (and
    some gateways) answer 501, and retries that for ~30 s before copying: every save waited.
    """

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        assert self.fs is not None, "the writer opened its filesystem before writing"
        self.fs.copy(str(path), str(new_path))
        self.fs.rm(str(path))


class CheckpointWriter(FsspecWriter):
    """DCP's fsspec writer, recording the checkpoint's URL in ``.metadata`` without credentials,
    taking the checksums of the shard files as they are written (:attr:`checksums`, on rank 0),
    and renaming on object stores by copy and delete (:class:`_ServerSideRenames`)."""

    def __init__(self, path: str, sync_files: bool) -> None:
        super().__init__(path, sync_files=sync_files)
        opened = self.fs
        assert isinstance(opened, FsspecFileSystem), "FsspecWriter opens an fsspec filesystem"
        # a local rename is atomic: kept
        self.files = _SummedFiles() if isinstance(opened.fs, LocalFileSystem) else _ServerSideRenames()
        self.files.fs = opened.fs
        # torch types the attribute as its base class's local FileSystem, though FsspecWriter
        # itself keeps an fsspec FileSystem there, as here.
        self.fs = self.files  # type: ignore[assignment]
        self.checksums: Checksums | None = None
        self.planned = 0  # bytes of tensors to write: this rank's, on rank 0 every rank's

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.planned = _planned_bytes([plan])
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.planned = _planned_bytes(plans)  # rank 0
        return super().prepare_global_plan(plans)

    def explained(self, error: BaseException) -> BaseException:
        """``error``, or where a rank ran out of space, :class:`SaveFailed` saying so (DCP's
        CheckpointException, which lists every rank's errors, and writes a traceback for each)."""
        if not no_space_left(error):
            return error
        folder = posixpath.dirname(str(self.path).rstrip("/"))
        return SaveFailed.no_space(folder, f" (need ~{self.planned / 1e9:.3g} GB for a checkpoint)")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's shards as DCP does, but in two files: ``__<rank>_0.distcp`` the
        shards of sharded tensors, ``__<rank>_1.distcp`` the other entries (on rank 0, those
        every rank reads: :class:`CheckpointSavePlanner`), each only where it has any. A rank
        loading then reads none of another rank's shards: an object store that reads a whole
        object for a ranged request (moto) read all of rank 0's shards for every rank. Its
        results, which DCP hands rank 0's :meth:`finish`, also carry the checksums of the files
        (:class:`_WrittenFile`)."""
        files: queue.Queue = queue.Queue()
        for index, shards in enumerate((True, False)):
            items = [item for item in plan.items if (item.type == WriteItemType.SHARD) == shards]
            if items:
                name = f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, items))
        # DCP's writer without its split of the items into files (by size, for its threads).
        results: list[Any] = self._write_data(planner, files).wait()
        results += [_WrittenFile(name, sums.checksums()) for name, sums in self.files.written.items()]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0, every rank's shards written: keeps the checksums of their files in
        :attr:`checksums`, then writes ``.metadata`` of the rest, as DCP does."""
        written = {item.name: item.checksums for rank in results for item in rank if isinstance(item, _WrittenFile)}
        results = [[item for item in rank if isinstance(item, WriteResult)] for rank in results]
        names = {item.storage_data.relative_path for rank in results for item in rank}
        self.checksums = Checksums(CHECKSUM_BLOCK_BYTES, {name: written[name] for name in names})
        super().finish(metadata, results)

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = redact_urls(str(meta.checkpoint_id))
        return meta


def _planned_bytes(plans: list[SavePlan]) -> int:
    """The bytes of the tensor pieces that ``plans`` write (without torch.save's few per entry)."""
    return sum(
        math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        for plan in plans
        for item in plan.items
        if item.tensor_data is not None
    )
