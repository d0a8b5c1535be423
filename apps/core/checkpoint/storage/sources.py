"""Where a reader's bytes of a shard file come from: the file in place, bytes fetched from it, or
a stream of it, each block checked against its checksum on the way.

The readers differ in how bytes arrive (:mod:`apps.core.checkpoint.storage.reader` reads files
in place, :mod:`apps.core.checkpoint.storage.batched_reader` fetches or streams them from object
stores); an entry is read the same way from any of them
(:class:`apps.core.checkpoint.storage.entries.EntryView`).
"""

import asyncio
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsspec.asyn import AsyncFileSystem, sync

from apps.core.checkpoint.storage.checksums import FileChecksums, check_blocks
from apps.core.checkpoint.storage.errors import DamagedCheckpoint


class Source:
    """A shard file's bytes from its byte ``start`` on, as ``stream`` holds them (the file, or
    bytes fetched from it)."""

    def __init__(self, stream: Any, start: int) -> None:
        self.stream, self.start = stream, start

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Reads the file's bytes from ``offset`` into ``buffer``; returns how many (fewer at its end)."""
        self.stream.seek(offset - self.start)
        return self.stream.readinto(buffer) or 0

    def release(self, offset: int) -> None:
        """Says that no byte before ``offset`` will be read again (entries are loaded in file order)."""


class CheckedSource(Source):
    """A :class:`Source` that checks every block of the file that it reads a byte of against
    ``sums``: blocks a read covers whole where they were read into, a block it covers in part
    read whole once, checked and kept for the reads after it (an entry's headers, the start of
    the entry after it). ``path`` names the file in errors.

    ``checker`` (a thread) checks each run of blocks while the next is read: reads and zlib's
    CRC-32 both release the GIL, so a large read costs about as long as the longer of the two
    (in series, CRC-32 at ~3.5 GB/s on one core made a 512 MB load from disk 1.5x as long).
    """

    #: Blocks read in part kept: an entry's first and last, and the next entry's.
    KEPT = 4
    #: Blocks read before they are handed to the checker.
    RUN = 4

    def __init__(
        self, stream: Any, start: int, path: str, block: int, sums: FileChecksums, checker: ThreadPoolExecutor
    ) -> None:
        super().__init__(stream, start)
        self.path, self.block, self.sums, self.checker = path, block, sums, checker
        self.kept: dict[int, bytes] = {}

    def readinto(self, offset: int, buffer: memoryview) -> int:
        end = min(offset + len(buffer), self.sums.size)
        # where the blocks that [offset, end) covers whole end: the file's end is a block's
        whole_to = end if end == self.sums.size else end - end % self.block
        pos = offset
        while pos < end:
            index, into = divmod(pos, self.block)
            if into == 0 and whole_to > pos:
                self._read_checked(pos, buffer[pos - offset : whole_to - offset])
                pos = whole_to
            else:
                kept = self._kept(index)
                part = kept[into : into + end - pos]
                buffer[pos - offset : pos - offset + len(part)] = part
                pos += len(part)
        return max(0, end - offset)

    def _read_checked(self, offset: int, into: memoryview) -> None:
        """Reads the whole blocks from ``offset`` into ``into``, each run of them checked while the
        next is read."""
        run = self.block * self.RUN
        checked: ConcurrentFuture | None = None
        for start in range(0, len(into), run):
            part = into[start : start + run]
            self._read_exactly(offset + start, part)
            if checked is not None:
                checked.result()
            checked = self.checker.submit(self._check, offset + start, part)
        if checked is not None:
            checked.result()

    def _read_exactly(self, offset: int, into: memoryview) -> None:
        got = super().readinto(offset, into)
        while got < len(into):
            more = super().readinto(offset + got, into[got:])
            if not more:
                raise DamagedCheckpoint(
                    f"{self.path} ends at byte {offset + got}, not {self.sums.size}: it is truncated"
                )
            got += more

    def _check(self, offset: int, data: memoryview) -> None:
        check_blocks(self.path, self.block, self.sums, offset, data)

    def _kept(self, index: int) -> bytes:
        """Block ``index``, read whole and checked."""
        if index not in self.kept:
            data = bytearray(min(self.block, self.sums.size - index * self.block))
            self._read_checked(index * self.block, memoryview(data))
            if len(self.kept) == self.KEPT:
                del self.kept[min(self.kept)]
            self.kept[index] = bytes(data)
        return self.kept[index]


#: Blocks of a streamed file that may arrive ahead of the one being loaded.
_STREAM_AHEAD_BLOCKS = 8


class StreamedSource(Source):
    """A whole shard file, ``path`` of the async fsspec file system ``fs``, as one request streams
    it: each block is checked against ``sums`` as it arrives, then read into the tensors, while up
    to ``_STREAM_AHEAD_BLOCKS`` more arrive (on fsspec's event loop). Blocks are kept from the
    start of the entry being loaded on (:meth:`release`), since a ``torch.save`` entry is read from
    its end (its zip directory) first. ``name`` names the file in errors. :meth:`close` it."""

    def __init__(self, fs: AsyncFileSystem, path: str, name: str, block: int, sums: FileChecksums) -> None:
        super().__init__(None, 0)
        self.fs, self.name, self.block, self.sums = fs, name, block, sums
        self.kept: dict[int, bytes] = {}
        self.arrived = 0  # blocks
        self.blocks: asyncio.Queue = sync(fs.loop, _queue)
        self.pump = asyncio.run_coroutine_threadsafe(self._pump(path), fs.loop)

    async def _pump(self, path: str) -> None:
        """Reads the file's blocks into :attr:`blocks` in order (an error in their place)."""
        try:
            file = await self.fs.open_async(path, "rb")
            for _ in range(-(-self.sums.size // self.block)):
                data = [await file.read(self.block)]
                while data[-1] and sum(map(len, data)) < self.block:
                    data.append(await file.read(self.block - sum(map(len, data))))
                await self.blocks.put(b"".join(data))
        except Exception as e:  # noqa: BLE001 - raised where the block is read
            await self.blocks.put(e)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        end = min(offset + len(buffer), self.sums.size)
        pos = offset
        while pos < end:
            index, into = divmod(pos, self.block)
            with memoryview(self._block(index)) as data, data[into : into + end - pos] as part:
                buffer[pos - offset : pos - offset + len(part)] = part
                pos += len(part)
        return max(0, end - offset)

    def _block(self, index: int) -> bytes:
        """Block ``index``, arrived and checked."""
        while self.arrived <= index:
            data = sync(self.fs.loop, self.blocks.get)
            if isinstance(data, Exception):
                raise data
            start = self.arrived * self.block
            if len(data) != min(self.block, self.sums.size - start):
                raise DamagedCheckpoint(
                    f"{self.name} ends at byte {start + len(data)}, not {self.sums.size}: it is truncated"
                )
            check_blocks(self.name, self.block, self.sums, start, data)
            self.kept[self.arrived] = data
            self.arrived += 1
        return self.kept[index]

    def release(self, offset: int) -> None:
        for index in [index for index in self.kept if (index + 1) * self.block <= offset]:
            del self.kept[index]

    def close(self) -> None:
        """Stops the request where it is still under way."""
        self.pump.cancel()


async def _queue() -> asyncio.Queue:
    """A queue of streamed blocks, made on the event loop that fills it."""
    return asyncio.Queue(maxsize=_STREAM_AHEAD_BLOCKS)
