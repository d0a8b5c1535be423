"""Shrinks an unpacked fbgemm-gpu wheel, in place, to what an sm_90 GPU (H100, H200) running this
project loads, so that the whole GPU stack travels to a lent machine in one device call (< 64 MiB
with the project; prepare.sh packs it).

    python3 scripts/gpu_stage/slim_fbgemm.py DIR    # DIR holds fbgemm_gpu/ (the unpacked wheel)

fbgemm-gpu 1.6.0's CUDA libraries keep their kernels in an ELF section ``.nv_fatbin``: a run of
fatbin containers, each with one entry (a cubin, or PTX) per GPU architecture; 1.6.0 has cubins for
sm_80, sm_90 and sm_100 and no PTX. The CUDA driver picks the entry of the GPU's architecture and
never reads the others. This overwrites with zeros the payloads of:

- every entry of another architecture than sm_90;
- sm_90 cubins of libraries the training path never calls (:data:`UNUSED_LIBRARIES`);
- sm_90 cubins whose kernels serve only optimizers no app offers (:data:`UNUSED_OPTIMIZERS`;
  every ``--embedding_optimizer`` choice, adagrad included, is kept).

Each file keeps its size and layout, so the dynamic loader and the CUDA driver read it as before,
and xz turns the zeros into nothing (465 MB wheel -> ~55 MB). A kernel zeroed by mistake fails
loudly when launched ("no kernel image is available for execution on the device"), never silently.
Compressed entries are left alone where their kernel names would have to be read.
"""

import re
import struct
import sys
from collections import Counter
from pathlib import Path

#: The architecture kept: Hopper, the lent machines' H200 (and H100).
KEEP_ARCH = 90
#: Libraries whose kernels this project never launches: variable-batch (VBE) and global-weight-
#: decay backward (the apps use neither), quantized inference (export and predict run on CPU).
UNUSED_LIBRARIES = frozenset(
    {
        "fbgemm_gpu_tbe_training_backward_vbe.so",
        "fbgemm_gpu_tbe_training_backward_gwd.so",
        "fbgemm_gpu_tbe_inference.so",
    }
)
#: FBGEMM's fused table optimizers that no app's --embedding_optimizer selects (the apps offer
#: rowwise_adagrad, adagrad, sgd and adam: apps/core/config.py's EMBEDDING_OPTIMIZERS).
UNUSED_OPTIMIZERS = frozenset(
    {"partial_rowwise_lamb", "partial_rowwise_adam", "rowwise_adagrad_with_counter", "lamb", "lars_sgd"}
)
#: The optimizer in the name of FBGEMM's generated TBE kernels, e.g.
#: ``split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1``.
OPTIMIZER_IN_KERNEL = re.compile(
    rb"(?:backward_codegen_|gen_embedding_backward_|forward_codegen_)([a-z_]+?)_"
    rb"(?:unweighted|weighted|split|dense|ssd|vbe|nobag|kernel)"
)

FATBIN_MAGIC = 0xBA55ED50
CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of its entries
ENTRY = struct.Struct("<HHIQ")  # kind, unknown, header size, payload size
ENTRY_ARCH_AT = 28  # uint32 sm_XY as XY, from the entry's start
ENTRY_FLAGS_AT = 40  # uint64
COMPRESSED = 0x2000  # a flag: the payload is compressed


class NotAFatbin(ValueError):
    """The section does not hold fatbin containers as laid out above: nothing is written."""


def section(data: bytes, wanted: str) -> tuple[int, int] | None:
    """(file offset, size) of the 64-bit little-endian ELF section named ``wanted``, if any."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise NotAFatbin("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    names_at = header(shstrndx)[1]
    for i in range(shnum):
        name, offset, size = header(i)
        if data[names_at + name : data.index(b"\0", names_at + name)].decode() == wanted:
            return offset, size
    return None


def entries(data: bytes, start: int, end: int):
    """(payload offset, payload size, arch, flags) of every entry of the containers in [start, end)."""
    at = start
    while at < end:
        if end - at < CONTAINER.size:
            raise NotAFatbin(f"{end - at} stray bytes at {at:#x}")
        magic, _, header_size, size = CONTAINER.unpack_from(data, at)
        if magic != FATBIN_MAGIC:
            if data[at : at + 8] == bytes(8):  # padding between containers
                at += 8
                continue
            raise NotAFatbin(f"no fatbin container at {at:#x}")
        entry, container_end = at + header_size, at + header_size + size
        while entry < container_end:
            _, _, entry_header, payload = ENTRY.unpack_from(data, entry)
            arch = struct.unpack_from("<I", data, entry + ENTRY_ARCH_AT)[0]
            flags = struct.unpack_from("<Q", data, entry + ENTRY_FLAGS_AT)[0]
            yield entry + entry_header, payload, arch, flags
            entry += entry_header + payload
        if entry != container_end:
            raise NotAFatbin(f"the entries of the container at {at:#x} overrun it")
        at = container_end


def why_unneeded(library: str, arch: int, flags: int, payload: bytes) -> str:
    """Why an sm_90 GPU never loads this entry, or "" when it may."""
    if arch != KEEP_ARCH:
        return f"sm_{arch}"
    if library in UNUSED_LIBRARIES:
        return "unused library"
    if flags & COMPRESSED:
        return ""  # its kernel names cannot be read: kept
    optimizers = {name.decode() for name in OPTIMIZER_IN_KERNEL.findall(payload)}
    return "unused optimizer" if optimizers and optimizers <= UNUSED_OPTIMIZERS else ""


def slim(path: Path) -> Counter:
    """Zeroes the unneeded payloads of one shared object in place; bytes zeroed, by reason."""
    data = bytearray(path.read_bytes())
    found = section(data, ".nv_fatbin")
    zeroed: Counter = Counter()
    if found is None:
        return zeroed
    start, size = found
    # Read every entry before writing any: a section that is not as expected changes nothing.
    for offset, length, arch, flags in list(entries(data, start, start + size)):
        why = why_unneeded(path.name, arch, flags, bytes(data[offset : offset + length]))
        if why:
            data[offset : offset + length] = bytes(length)
            zeroed[why] += length
    if zeroed:
        path.write_bytes(data)
    return zeroed


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not (Path(argv[0]) / "fbgemm_gpu").is_dir():
        sys.exit("usage: slim_fbgemm.py DIR, where DIR holds fbgemm_gpu/ (an unpacked fbgemm-gpu wheel)")
    total: Counter = Counter()
    for library in sorted((Path(argv[0]) / "fbgemm_gpu").rglob("*.so")):
        zeroed = slim(library)
        total.update(zeroed)
        if zeroed:
            print(
                f"{library.name}: zeroed " + ", ".join(f"{why} {n / 1e6:.1f} MB" for why, n in sorted(zeroed.items()))
            )
    print(
        f"slim_fbgemm.py: zeroed {sum(total.values()) / 1e6:.0f} MB: "
        + (", ".join(f"{why} {n / 1e6:.0f} MB" for why, n in sorted(total.items())) or "nothing (no fatbins)")
    )


if __name__ == "__main__":
    main(sys.argv[1:])
