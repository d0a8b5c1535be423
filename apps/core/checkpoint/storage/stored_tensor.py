"""Where a plain tensor's bytes lie in a ``torch.save`` entry, found without ``torch.load``.

A ``torch.save`` entry is a zip archive; reading its directory and its ``data.pkl`` (with an
unpickler that builds the tensor's layout and nothing else) says where the storage's bytes start,
so that a load reads them straight into the tensor they load into
(:func:`apps.core.checkpoint.storage.entries.load_item`) instead of into a new one and copying.
"""

import collections
import io
import pickle
import struct
import sys
import zipfile
from typing import Any, NamedTuple

import torch

from apps.core.checkpoint.storage.errors import DamagedCheckpoint
from apps.core.checkpoint.storage.unpickling import RestrictedUnpickler


class StoredTensor(NamedTuple):
    """A plain tensor in a ``torch.save`` entry: its layout (a meta tensor of its dtype, size,
    strides and storage offset), where its storage's bytes start, how many elements it holds."""

    layout: torch.Tensor
    start: int
    numel: int


# What a damaged entry, or one that is not a plain tensor, raises while it is parsed: it then goes
# to torch.load, which loads it or raises its own error, as with DCP's reader.
_NOT_PLAIN = (
    zipfile.BadZipFile,
    pickle.UnpicklingError,
    struct.error,
    KeyError,
    IndexError,
    EOFError,
    ValueError,
    TypeError,
    OverflowError,
    RuntimeError,
)


def stored_tensor(entry: io.RawIOBase, length: int) -> StoredTensor | None:
    """The :class:`StoredTensor` that ``entry`` (a file of ``length`` bytes) holds, or None where
    it holds anything else.

    A ``torch.save`` entry is a zip archive: ``data.pkl`` pickles how to rebuild the tensor from
    its storage, ``data/<key>`` holds the storage's bytes, stored uncompressed and aligned. Plain
    means: one strided tensor, of a dtype with a storage type of its own, in this machine's
    byte order, every record stored, and every element inside the entry.
    """
    try:
        archive = zipfile.ZipFile(entry)
        records = archive.infolist()
        prefix = records[0].filename.split("/")[0]
        if any(record.compress_type != zipfile.ZIP_STORED for record in records):
            return None
        if archive.read(f"{prefix}/byteorder").decode() != sys.byteorder:
            return None
        layout = _TensorUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
        if not isinstance(layout, _Layout):
            return None
        storage = archive.getinfo(f"{prefix}/data/{layout.storage.key}")
        start = _data_start(entry, storage)
        tensor = torch.empty(layout.storage.numel, dtype=layout.storage.dtype, device="meta")
        tensor = tensor.as_strided(layout.size, layout.stride, layout.offset)
    except DamagedCheckpoint:
        raise  # a ValueError too, but no other reader could read what failed its checksum
    except _NOT_PLAIN:
        return None
    numel = layout.storage.numel
    if storage.file_size != numel * tensor.element_size() or start + storage.file_size > length:
        return None  # not the bytes of its storage, or not all inside the entry
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return StoredTensor(tensor, start, numel) if tensor.numel() == 0 or last < numel else None


# A zip record's local header (PKWARE's APPNOTE.TXT 4.3.7), as zipfile reads it under private names.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_HEADER_SIGNATURE = b"PK\003\004"


def _data_start(entry: io.RawIOBase, record: zipfile.ZipInfo) -> int:
    """Where the bytes of the zip record ``record`` start: after its local header, whose name and
    extra field (which torch pads to align the bytes) have lengths of their own."""
    entry.seek(record.header_offset)
    header = _LOCAL_HEADER.unpack(entry.read(_LOCAL_HEADER.size))
    if header[0] != _LOCAL_HEADER_SIGNATURE:
        raise zipfile.BadZipFile(f"no local header at {record.header_offset}")
    return record.header_offset + _LOCAL_HEADER.size + header[-2] + header[-1]


# The storage types torch.save names for the dtypes that have one. Newer dtypes (the float8s,
# uint16...) are pickled through another rebuild function and load through torch.load.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _NotPlain(pickle.UnpicklingError):
    """A tensor entry's ``data.pkl`` is not that of one plain tensor."""


class _Storage(NamedTuple):
    dtype: torch.dtype
    key: str
    numel: int


class _Layout(NamedTuple):
    storage: _Storage
    offset: int
    size: tuple
    stride: tuple


def _layout(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> _Layout:
    """Stands in for ``torch._utils._rebuild_tensor_v2``: what it would rebuild the tensor from."""
    if not isinstance(storage, _Storage) or hooks or metadata:
        raise _NotPlain("a tensor with hooks or metadata of its own")
    return _Layout(storage, offset, size, stride)


class _TensorUnpickler(RestrictedUnpickler):
    """Reads the ``data.pkl`` that ``torch.save`` writes for one plain tensor into its
    :class:`_Layout`, and builds nothing else: any other global (another object, a tensor
    subclass, ``os.system``...), and any state to set, raise ``pickle.UnpicklingError`` unloaded."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict  # the tensor's backward hooks, none
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise self.refused(f"load {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        kind, dtype, key, _, numel = pid if isinstance(pid, tuple) and len(pid) == 5 else (None,) * 5
        if (
            kind != "storage"
            or not isinstance(dtype, torch.dtype)
            or not isinstance(key, str)
            or not isinstance(numel, int)
        ):
            raise _NotPlain(f"storage {pid!r}")
        return _Storage(dtype, key, numel)
