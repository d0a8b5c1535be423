"""The checkpoint reader: DCP's fsspec reader, reading ``.metadata`` and every entry without
running code from them, and checking every block it reads.

It reads files in place (a local disk); its subclass
(:class:`apps.core.checkpoint.storage.batched_reader.BatchedFsspecReader`) changes only where the
bytes come from, for object stores.
"""

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Iterator, cast

from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from apps.core.checkpoint.storage.checksums import Checksums
from apps.core.checkpoint.storage.entries import EntryView, load_item
from apps.core.checkpoint.storage.metadata import read_metadata_file
from apps.core.checkpoint.storage.sources import CheckedSource, Source
from apps.core.urls import redact_urls


class CheckpointReader(FsspecReader):
    """DCP's fsspec reader, reading ``.metadata`` with a restricted unpickler instead of
    ``pickle.load`` (:func:`read_metadata_file`), and tensors straight into the tensors they load
    into (:func:`load_item`), checking every block read against ``checksums`` (None: a checkpoint
    written before they were recorded, read unchecked). Every read of our checkpoints goes
    through it (and its subclass)."""

    def __init__(
        self, path: str, checksums: Checksums | None = None, metadata: dcp_metadata.Metadata | None = None
    ) -> None:
        super().__init__(path)
        self.checksums = checksums
        self.metadata = metadata

    def read_metadata(self) -> dcp_metadata.Metadata:
        """The checkpoint's ``.metadata``, checked; the one given at construction where it was
        already read (a resume reads it to plan the optimizer states' conversion, then loads:
        one request to the object store and one restricted unpickling, not two)."""
        # No **kwargs: DCP then never falls back to per-rank metadata files, which we never write.
        metadata = self.metadata or self._read_metadata()
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata(self) -> dcp_metadata.Metadata:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            # torch types the stream as io.IOBase; opened "rb", it is a binary file.
            return read_metadata_file(cast(IO[bytes], f), str(path))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Loads every entry of ``plan`` with :func:`load_item`, in file order."""
        items = sorted(
            ((req, self.storage_data[req.storage_index]) for req in plan.items),
            key=lambda item: (item[1].relative_path, item[1].offset),
        )
        if any(info.transform_descriptors for _, info in items):
            return super().read_data(plan, planner)  # compressed/transformed: DCP's own path
        for source, group in self._sources(items):
            for req, info in group:
                source.release(info.offset)
                load_item(EntryView(source, info), req, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _sources(self, items: list) -> Iterator[tuple[Source, list]]:
        """(a source, the items it holds) for every ``(req, info)`` of ``items`` (sorted by file
        and offset): here each file, opened once, its blocks checked as they are read
        (:class:`CheckedSource`) where the checkpoint has checksums."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-check") as checker:
            for name, group in itertools.groupby(items, key=lambda item: item[1].relative_path):
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                    if self.checksums is None:
                        yield Source(stream, 0), list(group)
                        continue
                    sums = self.checksums.of_file(name)
                    source = CheckedSource(stream, 0, self._named(name), self.checksums.block_bytes, sums, checker)
                    yield source, list(group)

    def _named(self, name: str) -> str:
        """The shard file ``name`` as errors name it (its URL, without credentials)."""
        return redact_urls(str(self.fs.concat_path(self.path, name)))
