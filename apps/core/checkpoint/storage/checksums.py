"""The CRC-32 checksums of a checkpoint's shard files, in blocks: what the manifest records, how
they are summed as bytes pass, and the check of bytes read against them.

The writer sums the bytes as it writes them and the readers check every block they read a byte
of; both sides meet here, so that a block means the same to the one that sums it and the one
that checks it.
"""

import dataclasses
import zlib
from typing import Any

from apps.core.checkpoint.storage.errors import DamagedCheckpoint


@dataclasses.dataclass(frozen=True)
class FileChecksums:
    """A shard file's size and the CRC-32 of each of its blocks."""

    size: int
    crc32: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Checksums:
    """The checksums of a checkpoint's shard files, by name, in blocks of ``block_bytes``: taken
    from the bytes as they were written (no second read), kept in the checkpoint's manifest (JSON,
    :meth:`record`), checked by every load (:mod:`apps.core.checkpoint.storage.sources`)."""

    block_bytes: int
    files: dict[str, FileChecksums]

    def record(self) -> dict[str, Any]:
        """The manifest's record of them."""
        files = {name: {"size": sums.size, "crc32": list(sums.crc32)} for name, sums in sorted(self.files.items())}
        return {"block_bytes": self.block_bytes, "files": files}

    @classmethod
    def of(cls, record: Any) -> "Checksums | None":
        """The checksums a manifest's ``record`` holds (None: a checkpoint written before they were
        recorded); raises :class:`DamagedCheckpoint` where the record is not one."""
        if record is None:
            return None
        try:
            block = record["block_bytes"]
            files = {name: FileChecksums(sums["size"], tuple(sums["crc32"])) for name, sums in record["files"].items()}
        except (TypeError, KeyError, AttributeError) as e:
            raise DamagedCheckpoint(f"manifest.json's checksums are malformed ({type(e).__name__}: {e})") from None
        if not (isinstance(block, int) and block > 0 and all(_fits(sums, block) for sums in files.values())):
            raise DamagedCheckpoint("manifest.json's checksums are malformed (a file's size and its blocks disagree)")
        return cls(block, files)

    def of_file(self, name: str) -> FileChecksums:
        """The checksums of the shard file ``name``; raises :class:`DamagedCheckpoint` without them."""
        if name not in self.files:
            raise DamagedCheckpoint(f"shard file {name} has no checksums in manifest.json")
        return self.files[name]


def _fits(sums: FileChecksums, block: int) -> bool:
    """Whether ``sums`` holds one 32-bit checksum per block of ``block`` bytes of a file of its size."""
    if not (isinstance(sums.size, int) and sums.size >= 0):
        return False
    blocks = -(-sums.size // block)
    return len(sums.crc32) == blocks and all(isinstance(c, int) and 0 <= c < 2**32 for c in sums.crc32)


class BlockSums:
    """The CRC-32 of each block of the bytes given to :meth:`add`, in the order they come."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.size = 0
        self.done: list[int] = []
        self.crc = 0  # of the block being filled

    def add(self, data: memoryview) -> None:
        while data:
            room = self.block_bytes - self.size % self.block_bytes
            self.crc = zlib.crc32(data[:room], self.crc)
            self.size += min(room, len(data))
            data = data[room:]
            if self.size % self.block_bytes == 0:
                self.done.append(self.crc)
                self.crc = 0

    def checksums(self) -> FileChecksums:
        return FileChecksums(self.size, (*self.done, self.crc) if self.size % self.block_bytes else tuple(self.done))


def check_blocks(path: str, block: int, sums: FileChecksums, offset: int, data: Any) -> None:
    """Checks ``data``, whole blocks of ``block`` bytes of the file ``path`` (the file's last one
    may be shorter) read from ``offset``, against ``sums``; raises :class:`DamagedCheckpoint`."""
    with memoryview(data) as view:
        for start in range(0, len(view), block):
            if zlib.crc32(view[start : start + block]) != sums.crc32[(offset + start) // block]:
                first = offset + start
                last = min(first + block, offset + len(view)) - 1
                raise DamagedCheckpoint(f"{path}: bytes {first}-{last} do not match their checksum")
