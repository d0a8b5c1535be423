"""An inference package: what ``components.dlrm:export`` writes and prediction and notebooks load.

A folder (local or any fsspec URL) of two files::

    model.pt2      the program (apps.dlrm.serving.program): torch.export's archive, its weights
                   and constants stored as raw bytes
    manifest.json  what the program needs around it (features, id and dense transforms, the
                   model's options, the training run's metrics, the source checkpoint, the
                   program's SHA-256), written last: a folder without it is no package

Written atomically: a local package is made in a temporary folder beside its place (the folder a
link points to, for a linked place) and renamed into it; on an object store the program is
uploaded first and the manifest last (each upload appears whole or not at all), so a package
counts only once complete. A place that already holds a package, or anything else, is refused:
nothing is overwritten; so is a local place where no folder can be made (a read-only disk), before
export's work. A write that fails (a full disk) is one line naming the place, the temporary folder
removed.

Nothing from a package is unpickled beyond tensors, and nothing in it runs as Python. Found in
torch's own loader (``torch.export.load``, torch 2.13): it ``torch.load``s with
``weights_only=False`` any weight or constant whose entry says ``use_pickle``, unpickles TorchBind
and opaque constants, and retries the sample inputs with ``weights_only=False`` when they fail
with ``weights_only=True``; it resolves a graph node's target as any attribute path under
``torch`` (``torch.os.system``); it hands every symbolic size (``expr_str``) to
``sympy.sympify``, which evaluates it as Python; it reads the first zip entry of a name and finds
names ignoring case (where ``zipfile`` reads the last); and ``ExportedProgram.module()`` ``exec``s
the archive's guards as Python source. :func:`check_archive` therefore refuses, before torch reads
a byte, an archive with two entries of one name (or of names equal but for case), a pickled weight
or constant, TorchBind or opaque objects, a legacy pickled state dict, sample inputs that
``weights_only=True`` cannot load, a graph node calling anything but an operator of the aten,
prims or fbgemm namespace or of a few arithmetic functions, a symbolic size or range constraint's
name that is not the integer arithmetic torch writes, a guard that is not arithmetic on input
sizes, or any file a program does not have; torch then loads the very bytes that were checked.
(TorchScript, the alternative, compiles Python-like source from its archive, and its constants
are pickles too.)
"""

import ast
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from typing import IO, Any, Iterator, cast

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.export import ExportedProgram

from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls
from apps.dlrm.serving.outputs import refuse_existing
from apps.dlrm.serving.program import quiet_torch

PACKAGE_FORMAT = "torchrec-dlrm-inference-package"
#: Bumped whenever a package's meaning changes: a reader refuses the formats it does not know.
FORMAT_VERSION = 1
PROGRAM_FILE = "model.pt2"
MANIFEST_FILE = "manifest.json"

#: The operator namespaces a program may call: ATen's and prims' kernels, FBGEMM's table kernels.
_OPERATOR_NAMESPACES = ("aten", "prims", "fbgemm")
#: The Python functions on symbolic sizes that ``torch.export`` graphs call.
_SIZE_FUNCTIONS = {
    f"_operator.{name}"
    for name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge")
} | {"_operator.getitem", "math.ceil", "math.floor", "math.trunc", "math.sqrt", "torch.sym_not"}
#: What a guard may be made of: comparisons and arithmetic of integers and the inputs' sizes, and
#: calls of these functions (the names guards call, which torch evaluates with Python's builtins).
_GUARD_NODES = (
    ast.Expression,
    ast.Compare,
    ast.BinOp,
    ast.BoolOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Call,
    ast.Load,
    ast.operator,
    ast.cmpop,
    ast.boolop,
    ast.unaryop,
)
_GUARD_FUNCTIONS = ("max", "min", "abs")
_INPUT_SIZE = re.compile(r"L\['(?:dense|values|lengths)'\]\.size\(\)\[\d+\]")
#: What a symbolic size may call (see :func:`_is_size_expression`): sympy's classes that ``srepr``
#: writes for integer arithmetic, comparisons and logic, and torch's integer functions on sizes
#: (torch.utils._sympy.functions, as torch's deserializer names them to sympify). Left out: powers
#: and shifts (numbers of any size from a few characters), and whatever works on floats.
_SIZE_EXPRESSION_CALLS = frozenset(
    (
        *("Integer", "Add", "Mul", "Max", "Min", "And", "Or", "Not"),
        *("Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan"),
        *("FloorDiv", "Mod", "PythonMod", "ModularIndexing", "CleanDiv", "CeilDiv", "Where", "Identity"),
        *("CeilToInt", "FloorToInt", "TruncToInt", "RoundToInt"),
    )
)
#: A size's symbol as torch names it: ``s`` (an input's size) or ``u`` (a size found while running,
#: as the ids' counts), and a number (torch.utils._sympy.symbol.prefix_str).
_SIZE_SYMBOL = re.compile(r"[su][0-9]+")
_SYMBOL_ASSUMPTIONS = frozenset(("integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite"))
#: The infix operators of a size's ``str`` (``26*s37``, ``s37 + 1``, ``s37//2``).
_SIZE_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
#: The files of a torch.export archive besides its folders' (text: versions, byte order, ids).
_ARCHIVE_TEXT_FILES = ("archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id")
_RAW_TENSOR_FILE = re.compile(r"data/(weights/weight_|constants/tensor_)\d+")


class PackageError(ConfigError):
    """A package cannot be used (or written); the message names it and says what to do."""


@dataclass
class Package:
    """A package read and checked: its manifest and its program's module."""

    url: str
    manifest: dict[str, Any]
    module: torch.nn.Module


# --- writing -----------------------------------------------------------------------------------


def check_place(url: str) -> None:
    """Refuses, in one line, a place for a package that holds anything (nothing is overwritten) or
    where none can be written: a local one whose nearest existing folder no folder can be made in
    (a read-only disk, a folder not ours, a file). Export calls it before the minutes of loading,
    :func:`write_package` again when it writes."""
    refuse_existing(url)
    fs, root = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        folder = _nearest_folder(os.path.dirname(_local_place(root)))
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".package-check-", dir=folder))
        except OSError as e:
            raise PackageError(
                f"--output {redact_urls(url)} cannot be written: no folder can be made in {folder} ({e.strerror or e}): "
                "give an --output you can write to"
            ) from None


def write_package(url: str, program: ExportedProgram, manifest: dict[str, Any]) -> dict[str, Any]:
    """Writes the package of ``program`` and ``manifest`` (completed with the program's file, size
    and SHA-256) to ``url``, atomically; returns the manifest written. A write that fails (a full
    or read-only disk) is one :class:`PackageError` naming ``url``, and leaves nothing there."""
    check_place(url)
    fs, root = fsspec.core.url_to_fs(url)
    local = isinstance(fs, LocalFileSystem)
    place = _local_place(root) if local else root
    parent = os.path.dirname(place) if local else None
    staging = None
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(place.rstrip('/'))}.tmp-", dir=parent)
        program_path = os.path.join(staging, PROGRAM_FILE)
        _save_program(program, program_path)
        with open(program_path, "rb") as f:
            check_archive(f, program_path)  # what we write is what our reader takes
        manifest = {**manifest, "program": {**manifest.get("program", {}), **_file_record(program_path)}}
        manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
        if local:
            with open(os.path.join(staging, MANIFEST_FILE), "wb") as f:
                f.write(manifest_bytes)
                f.flush()
                os.fsync(f.fileno())
            _rename_into(staging, place, url)
        else:
            fs.put_file(program_path, posixpath.join(root, PROGRAM_FILE))
            fs.pipe_file(posixpath.join(root, MANIFEST_FILE), manifest_bytes)  # last: the package counts
    except OSError as e:
        where = f" in {parent}" if parent else ""
        raise PackageError(
            f"--output {redact_urls(url)}: the package could not be written{where} ({e.strerror or e}); nothing "
            "was left there: free space (the package is about the size of its tables) or give another --output"
        ) from None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _local_place(root: str) -> str:
    """Where a local package goes: ``root`` with its links resolved, so that an --output linked to
    an empty folder receives the package in that folder (and the link stays)."""
    return os.path.realpath(root)


def _nearest_folder(path: str) -> str:
    """``path`` or its nearest ancestor that exists (the folder a package's folders are made in)."""
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _save_program(program: ExportedProgram, path: str) -> None:
    """``torch.export.save`` into the file ``path``, raising the OSError of a failed write (a full
    disk): torch's archive writer (C++) aborts the whole process when a write fails under it
    (SIGABRT, torch 2.13), so it writes through :class:`_KeptErrors`, which it never sees fail."""
    with open(path, "wb") as f:
        sink = _KeptErrors(f)
        torch.export.save(program, cast(IO[bytes], sink))  # a binary file as torch takes one
        if sink.error is not None:
            raise sink.error
        f.flush()
        os.fsync(f.fileno())


class _KeptErrors(io.RawIOBase):
    """A file's writes and seeks that keep the first OSError instead of raising it, dropping what
    follows: the caller raises it once the writer is done."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__()
        self.file = file
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.error is None:
            try:
                self.file.write(data)
            except OSError as e:
                self.error = e
        return memoryview(data).nbytes

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()


def _rename_into(staging: str, root: str, url: str) -> None:
    """Moves the complete package folder into place (over an empty folder at most)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # a folder made as any other, not mkdtemp's private one
    if os.path.isdir(root):
        os.rmdir(root)  # empty (refuse_existing): a concurrent writer's files would make it fail
    try:
        os.rename(staging, root)
    except OSError as e:
        raise PackageError(f"--output {url}: the package could not be moved into place ({e})") from None


def _file_record(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"file": PROGRAM_FILE, "bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


# --- reading -----------------------------------------------------------------------------------


def read_manifest(url: str) -> dict[str, Any] | None:
    """The manifest of the package at ``url``; None where ``url`` holds no manifest.json."""
    fs, root = fsspec.core.url_to_fs(url)
    path = posixpath.join(root, MANIFEST_FILE)
    if not fs.exists(path):
        return None
    try:
        manifest = json.loads(fs.cat_file(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise PackageError(f"{redact_urls(url)}/{MANIFEST_FILE} is not JSON ({e}): export the package again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACKAGE_FORMAT:
        return None
    return manifest


def read_package(url: str) -> Package:
    """The package at ``url``, every check passed (see the module docstring), its program loaded
    (``import torchrec`` first, as here, registers FBGEMM's operators that quantized tables call)."""
    manifest = read_manifest(url)
    if manifest is None:
        raise PackageError(
            f"{redact_urls(url)} is not an inference package (no {MANIFEST_FILE} of one): give the --output "
            "of components.dlrm:export"
        )
    check_manifest(manifest, url)
    fs, root = fsspec.core.url_to_fs(url)
    data = fs.cat_file(posixpath.join(root, PROGRAM_FILE))
    if hashlib.sha256(data).hexdigest() != manifest["program"]["sha256"]:
        raise PackageError(
            f"{redact_urls(url)}/{PROGRAM_FILE} is not the program its manifest names (its SHA-256 differs): "
            "the package was changed or damaged; export it again"
        )
    check_archive(io.BytesIO(data), f"{url}/{PROGRAM_FILE}")
    with quiet_torch():
        module = torch.export.load(io.BytesIO(data)).module()
    return Package(url, manifest, module)


def check_manifest(manifest: dict[str, Any], url: str) -> None:
    """Refuses a package of another format version, or exported with a newer torch than this."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise PackageError(
            f"{redact_urls(url)} is a package of format version {version}, but this version of the project reads "
            f"version {FORMAT_VERSION}: export the checkpoint again with this version (components.dlrm:export)"
        )
    exported_with = manifest.get("versions", {}).get("torch", "")
    if _major_minor(exported_with) > _major_minor(torch.__version__):
        raise PackageError(
            f"{redact_urls(url)} was exported with torch {exported_with}, newer than this torch "
            f"{torch.__version__}, which may not read its program: load it with torch {exported_with} or newer"
        )


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def check_archive(file: IO[bytes], name: str) -> None:
    """Refuses (:class:`PackageError`, naming the entry) an archive that torch's loader would
    unpickle anything but tensors from, or run code of: see the module docstring."""
    try:
        archive = zipfile.ZipFile(file)
    except zipfile.BadZipFile:
        raise PackageError(f"{redact_urls(name)} is not a torch.export archive: export the package again") from None
    with archive:
        _refuse_twins(archive.namelist(), name)
        for entry in archive.infolist():
            _check_entry(archive, entry, name)


def _refuse_twins(entries: list[str], name: str) -> None:
    """Refuses two entries of one name, or of names equal but for case: torch's reader (miniz)
    takes the first entry of a name and finds names ignoring case, where ``zipfile`` reads the last
    of a name, so a check by name could pass one entry and torch load the other."""
    seen: dict[str, str] = {}
    for entry in entries:
        twin = seen.setdefault(entry.lower(), entry)
        if twin is not entry:
            raise _planted(name, entry, f"a second entry of the name {twin!r} (torch would read one, a check another)")


def _check_entry(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, name: str) -> None:
    _, _, inner = entry.filename.partition("/")  # below the archive's root folder
    where = f"{name}:{entry.filename}"
    if inner in _ARCHIVE_TEXT_FILES or _RAW_TENSOR_FILE.fullmatch(inner):
        return
    if inner.startswith("models/") and inner.endswith(".json"):
        _check_graph(_json_entry(archive, entry, name), where)
    elif re.fullmatch(r"data/(weights|constants)/[^/]+_config\.json", inner):
        _check_payloads(_json_entry(archive, entry, name), where)
    elif re.fullmatch(r"data/sample_inputs/[^/]+\.pt", inner):
        try:
            torch.load(io.BytesIO(archive.read(entry)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever weights_only refuses, torch would unpickle freely
            raise _planted(
                name, entry.filename, f"sample inputs that are not plain tensors ({type(e).__name__})"
            ) from None
    else:
        raise _planted(name, entry.filename, "a file that no torch.export program of ours has")


def _json_entry(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, name: str) -> Any:
    try:
        return json.loads(archive.read(entry))
    except (ValueError, UnicodeDecodeError):
        raise _planted(name, entry.filename, "a file that should be JSON and is not") from None


def _check_payloads(config: Any, where: str) -> None:
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise _planted(where, str(config), "no list of tensor payloads")
    for fqn, payload in entries.items():
        raw = isinstance(payload, dict) and not payload.get("use_pickle")
        if not raw or not re.fullmatch(r"(weight|tensor)_\d+", str(payload.get("path_name"))):
            raise _planted(where, fqn, "a pickled object, not raw tensor bytes")


def _check_graph(program: Any, where: str) -> None:
    for node in _graph_nodes(program):
        target = str(node.get("target"))
        if target not in _SIZE_FUNCTIONS and not _is_operator(target):
            raise _planted(where, target, "a call of something that is not a tensor operator")
    for guard in program.get("guards_code", []) if isinstance(program, dict) else []:
        if not _is_size_guard(str(guard)):
            raise _planted(where, guard, "a guard that is not arithmetic on the inputs' sizes")
    for field, expression in _size_expressions(program):
        if not _is_size_expression(str(expression)):
            raise _planted(f"{where} ({field})", expression, "a symbolic size that is not arithmetic on sizes")


def _size_expressions(program: Any) -> Iterator[tuple[str, Any]]:
    """Every symbolic size of a serialized program, with where it is: each ``expr_str`` (of a
    sym_int, sym_bool or sym_float, a tensor's sizes, strides or offset), which torch's
    deserializer hands to ``sympy.sympify`` (torch/_export/serde/serialize.py, ``_parse_sym_expr``:
    that evaluates it as Python), and the names of the range constraints (which torch reads as a
    symbol's)."""
    ranges = program.get("range_constraints") if isinstance(program, dict) else None
    for key in ranges if isinstance(ranges, dict) else ():
        yield "range_constraints", key
    yield from _expr_strs(program, "")


def _expr_strs(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            field = f"{path}.{key}" if path else str(key)
            if key == "expr_str":
                yield field, item
            else:
                yield from _expr_strs(item, field)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _expr_strs(item, f"{path}.{i}")


def _is_size_expression(expression: str) -> bool:
    """Whether ``expression`` is what torch writes for a symbolic size: sympy's ``srepr`` of
    integer arithmetic, comparisons and logic on size symbols (``Add(Mul(Integer(26),
    Symbol('s37', positive=True, integer=True)), Integer(1))``; torch 2.11 and 2.13), or its
    infix ``str`` (``26*s37``, the range constraints' names). Nothing else reaches sympify: no
    attribute, subscript, string but a symbol's name, nor call but of :data:`_SIZE_EXPRESSION_CALLS`."""
    try:
        return _is_size_term(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):  # not Python, a NUL byte, nested past reason
        return False


def _is_size_term(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Name):
        return bool(_SIZE_SYMBOL.fullmatch(node.id))
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and _is_size_term(node.operand)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _SIZE_OPERATORS) and _is_size_term(node.left) and _is_size_term(node.right)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return False
    if node.func.id == "Symbol":
        return _is_size_symbol(node)
    return node.func.id in _SIZE_EXPRESSION_CALLS and not node.keywords and all(map(_is_size_term, node.args))


def _is_size_symbol(call: ast.Call) -> bool:
    """``Symbol('s37', positive=True, integer=True)``: a size's name and its assumptions."""
    name = call.args[0] if len(call.args) == 1 else None
    return (
        isinstance(name, ast.Constant)
        and isinstance(name.value, str)
        and bool(_SIZE_SYMBOL.fullmatch(name.value))
        and all(
            keyword.arg in _SYMBOL_ASSUMPTIONS
            and isinstance(keyword.value, ast.Constant)
            and type(keyword.value.value) is bool
            for keyword in call.keywords
        )
    )


def _graph_nodes(value: Any) -> Iterator[dict[str, Any]]:
    """Every graph node (a dict with a target and inputs) anywhere in a serialized program."""
    if isinstance(value, dict):
        if "target" in value and "inputs" in value:
            yield value
        for item in value.values():
            yield from _graph_nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _graph_nodes(item)


def _is_operator(target: str) -> bool:
    """``torch.ops.<namespace>.<op>.<overload>`` of a namespace in :data:`_OPERATOR_NAMESPACES`."""
    parts = target.split(".")
    return len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in _OPERATOR_NAMESPACES


def _is_size_guard(guard: str) -> bool:
    """Whether ``guard`` is integer arithmetic and comparisons of the inputs' sizes."""
    try:
        tree = ast.parse(_INPUT_SIZE.sub("0", guard), mode="eval")
    except SyntaxError:
        return False
    functions = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return all(
        (isinstance(node, _GUARD_NODES) and not isinstance(node, ast.Call) or _is_guard_call(node))
        and (not isinstance(node, ast.Constant) or type(node.value) is int)
        or isinstance(node, ast.Name)
        and id(node) in functions
        and node.id in _GUARD_FUNCTIONS
        for node in ast.walk(tree)
    )


def _is_guard_call(node: ast.AST) -> bool:
    """A call of one of :data:`_GUARD_FUNCTIONS` by name, with positional arguments only."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _GUARD_FUNCTIONS
        and not node.keywords
    )


def _planted(where: str, what: str, kind: str) -> PackageError:
    return PackageError(
        f"{redact_urls(where)} holds {str(what)[:200]!r}, {kind}: refused unread, nothing in it ran. The package "
        "was not written by components.dlrm:export (or was changed since): export it again, into a place only you "
        "can write to"
    )


def manifest_record(**fields: Any) -> dict[str, Any]:
    """The head of every manifest: the format and its version, then ``fields``."""
    return {"format": PACKAGE_FORMAT, "format_version": FORMAT_VERSION, **fields}
