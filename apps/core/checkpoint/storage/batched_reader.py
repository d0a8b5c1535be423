"""The checkpoint reader for object stores: many entries' bytes in one request, fetched or
streamed while the ones before them load.

Every request to an object store costs a round trip that a local read does not; this reader
differs from :class:`apps.core.checkpoint.storage.reader.CheckpointReader` only in how it makes
them, so it is a file of its own.
"""

import io
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from fsspec.asyn import AsyncFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.filesystem import _StorageInfo

from apps.core.checkpoint.storage.checksums import check_blocks
from apps.core.checkpoint.storage.errors import DamagedCheckpoint
from apps.core.checkpoint.storage.reader import CheckpointReader
from apps.core.checkpoint.storage.sources import Source, StreamedSource

# Bytes fetched per round trip when loading from an object store. A load holds two such batches
# beyond the model (one loading, the next one arriving).
_READ_BATCH_BYTES = 512 * 2**20


class BatchedFsspecReader(CheckpointReader):
    """DCP's fsspec reader, fetching the bytes of many entries in one request.

    DCP's own reader hands ``torch.load`` a view of the remote file, whose many small reads and
    seeks each become a request to the object store (over 3x slower than reading the same
    bytes here on S3). This one streams each file it reads whole (a rank's own shards) with
    one request, as a raw read of it would, each block checked and loaded into the tensors as
    it arrives while the next ones arrive (:class:`StreamedSource`; file systems with a
    streamed read, ``open_async``: s3fs), the next file's request started while one loads.
    Other files (read in part by a resharded load, or of a checkpoint without checksums, or
    where there is no streamed read) are fetched up to ``_READ_BATCH_BYTES`` of entries at once
    with fsspec's ``cat_ranges`` (concurrent on object stores), checked in the fetching thread
    as they arrive, and loaded from memory while the next batch arrives and is checked.
    """

    def _sources(self, items: list) -> Iterator[tuple[Source, list]]:
        """The streamed files, then the fetched batches of the rest."""
        streamed, batched = self._streamed(items)
        yield from self._streams(streamed)
        yield from self._fetched(batched)

    def _streamed(self, items: list) -> tuple[list[tuple[str, list]], list]:
        """``items`` split into (file, its items) of the files to stream, and the rest."""
        # fsspec's AsyncFileSystem declares open_async; the file systems that stream override it.
        if self.checksums is None or getattr(type(self._fsspec()), "open_async", None) in (
            None,
            AsyncFileSystem.open_async,
        ):
            return [], items
        streamed, batched = [], []
        for name, grouped in itertools.groupby(items, key=lambda item: item[1].relative_path):
            group = list(grouped)
            extent = (self._extent(group[0][1])[0], self._extent(group[-1][1])[1])
            if extent == (0, self.checksums.of_file(name).size):
                streamed.append((name, group))
            else:
                batched += group
        return streamed, batched

    def _streams(self, files: list[tuple[str, list]]) -> Iterator[tuple[Source, list]]:
        """A :class:`StreamedSource` of each of ``files``; the next one's request is made while one loads."""
        sources = [self._stream(name) for name, _ in files[:1]]
        try:
            for index, (_, group) in enumerate(files):
                if index + 1 < len(files):
                    sources.append(self._stream(files[index + 1][0]))
                yield sources[index], group
                sources[index].close()
        finally:  # a load that failed stops the requests under way
            for source in sources:
                source.close()

    def _stream(self, name: str) -> StreamedSource:
        assert self.checksums is not None, "only files with checksums are streamed"
        path = str(self.fs.concat_path(self.path, name))
        return StreamedSource(
            self._fsspec(), path, self._named(name), self.checksums.block_bytes, self.checksums.of_file(name)
        )

    def _fsspec(self) -> Any:
        # torch types self.fs as the local FileSystem of FsspecReader's base class; FsspecReader sets its fsspec one.
        fs = self.fs
        assert isinstance(fs, FsspecFileSystem) and fs.fs is not None, "FsspecReader opened the checkpoint's filesystem"
        return fs.fs

    def _fetched(self, items: list) -> Iterator[tuple[Source, list]]:
        """The fetched batches; the next one is fetched while this one loads into the tensors."""
        batches = _batches(items)
        if not batches:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-fetch") as fetcher:
            pending = fetcher.submit(self._fetch, batches[0])
            for following in batches[1:]:
                fetched = pending.result()
                pending = fetcher.submit(self._fetch, following)
                yield from fetched
            yield from pending.result()

    def _fetch(self, batch: list) -> list[tuple[Source, list]]:
        """The entries of ``batch`` fetched (with the rest of the checksum blocks they lie in),
        each run of adjacent ones (DCP writes a rank's tensors back to back) in one request,
        and checked where the checkpoint has checksums."""
        spans: list[list] = []  # [path, start, end, items]
        for item in batch:
            start, end = self._extent(item[1])
            if spans and spans[-1][0] == item[1].relative_path and start <= spans[-1][2]:
                spans[-1][2] = max(spans[-1][2], end)
                spans[-1][3].append(item)
            else:
                spans.append([item[1].relative_path, start, end, [item]])
        blobs = self._fsspec().cat_ranges(
            [self.fs.concat_path(self.path, path) for path, *_ in spans],
            [start for _, start, _, _ in spans],
            [end for _, _, end, _ in spans],
            on_error="raise",
        )
        for (name, start, end, _), blob in zip(spans, blobs):
            self._check_fetched(name, start, end, blob)
        # BytesIO shares the bytes: no copy
        return [(Source(io.BytesIO(blob), start), items) for (_, start, _, items), blob in zip(spans, blobs)]

    def _check_fetched(self, name: str, start: int, end: int, blob: bytes) -> None:
        """Checks ``blob``, the bytes ``[start, end)`` of the shard file ``name`` fetched (whole
        blocks: :meth:`_extent`), against its checksums where the checkpoint has them."""
        if self.checksums is None:
            return
        if len(blob) != end - start:
            raise DamagedCheckpoint(f"{self._named(name)} ends at byte {start + len(blob)}, not {end}: it is truncated")
        check_blocks(self._named(name), self.checksums.block_bytes, self.checksums.of_file(name), start, blob)

    def _extent(self, info: _StorageInfo) -> tuple[int, int]:
        """The bytes of its file to fetch for the entry ``info``: its own, and where they are
        checked, the rest of the blocks they lie in."""
        start, end = info.offset, info.offset + info.length
        if self.checksums is None:
            return start, end
        block = self.checksums.block_bytes
        return start - start % block, min(-(-end // block) * block, self.checksums.of_file(info.relative_path).size)


def _batches(items: list) -> list[list]:
    """``items`` (sorted ``(req, info)`` pairs) cut into as few runs of at most
    ``_READ_BATCH_BYTES`` as they fit in (an entry larger than that is a batch of its own), of
    about equal sizes: a batch loads while the next one arrives, which a short last one would not
    keep busy."""
    total = sum(item[1].length for item in items)
    even = total / max(1, math.ceil(total / _READ_BATCH_BYTES))
    batches: list[list] = [[]]
    size = 0
    for item in items:
        if batches[-1] and (size >= even or size + item[1].length > _READ_BATCH_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[1].length
    return batches if batches[0] else []
