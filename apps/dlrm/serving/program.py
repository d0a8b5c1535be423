"""The module an inference package holds, and its export with ``torch.export``.

:class:`Scorer` turns plain tensors into click probabilities, so that a serving stack needs no
TorchRec type at its boundary::

    dense    float32 [rows, dense features]   the dense features, as training read them
    values   int64   [ids]                    every row's ids (table rows) of feature 0, then of
                                              feature 1, ...: a KeyedJaggedTensor's values
    lengths  int32   [sparse features * rows] how many ids each row has of each feature, in the
                                              same order (feature-major): its lengths
    ->       float32 [rows]                   sigmoid of the DLRM's logit

Two rows or more: ``torch.export`` specialises a batch of one row (TorchRec's modules branch on
it), so :func:`score` scores a single row with an empty second one beside it.

The tables are TorchRec's unsharded EmbeddingBagCollection (``--quantize none``: float32, looked
up by ``aten.embedding_bag``; the program needs torch alone) or TorchRec's quantized
EmbeddingBagCollection (``fp16``, ``int8`` row-wise: each row's 8-bit values with its own scale
and bias), whose lookups are FBGEMM's inference kernels (the program needs FBGEMM's operators:
``import torchrec`` or ``import fbgemm_gpu`` before loading it).

Why ``torch.export`` rather than TorchScript, both measured (benchmarks/predict_throughput.py, one
thread, 26 tables of 500,000 rows of 16 floats, batches of 8,192): they score alike, the module
alone 210k (float32) and 218k (int8) rows per CPU-second exported against 213k and 225k
scripted, and their files are the same size (TorchScript loaded faster in a first measurement,
0.2 s against 0.6-1.9 s for 166 MB of tables). What decides: a torch.export archive is a
JSON graph of operators and raw tensor bytes, which :mod:`apps.dlrm.serving.package` can check so
that nothing in it runs, where a TorchScript archive holds Python-like source that loading
compiles, and pickles; TorchScript is in maintenance in PyTorch, torch.export is what TorchRec's
serving path (torchrec.ir) and AOTInductor build on; and a float32 program needs torch alone. Both
hold the tables' bytes once (TorchRec's quantized module registers per-table views of its kernel's
weights as well: :func:`quantize_tables` drops them, else ``torch.export`` would save them twice).
"""

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver, QConfig
from torch.export import Dim, ExportedProgram
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.config import ModelConfig
from apps.dlrm.model import feature_names

_QUANTIZED_DTYPES = {"fp16": torch.float16, "int8": torch.quint8}
#: The batch sizes and id counts the exported program accepts (its dynamic dimensions' bounds).
MIN_ROWS = 2
MAX_ROWS = 2**24
MAX_IDS = 2**40


class Scorer(nn.Module):
    """A DLRM's click probabilities of rows given as plain tensors (see the module docstring)."""

    def __init__(self, dlrm: DLRM, keys: list[str]) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.keys = keys

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        return torch.sigmoid(self.dlrm(dense, features)).reshape(-1)


def scorer(dlrm: DLRM, cfg: ModelConfig) -> Scorer:
    return Scorer(dlrm, feature_names(cfg.num_sparse_features)).eval()


def quantize_tables(dlrm: DLRM, quantize: str) -> None:
    """Replaces the DLRM's tables by TorchRec's quantized ones (``fp16``, or ``int8`` row-wise), in
    place; ``none`` keeps them float32."""
    if quantize == "none":
        return
    holder = dlrm.sparse_arch.embedding_bag_collection
    if isinstance(holder, ManagedCollisionEmbeddingBagCollection):  # --categorical_ids zch: its tables
        holder._embedding_module = quantized_tables(holder._embedding_bag_collection, quantize)
    else:
        dlrm.sparse_arch.embedding_bag_collection = quantized_tables(holder, quantize)


def quantized_tables(tables: EmbeddingBagCollection, quantize: str) -> nn.Module:
    """TorchRec's quantized EmbeddingBagCollection of ``tables``."""
    tables.qconfig = QConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.float),
        weight=PlaceholderObserver.with_args(dtype=_QUANTIZED_DTYPES[quantize]),
    )
    quantized = QuantEmbeddingBagCollection.from_float(tables)
    for view in getattr(quantized, "embedding_bags", nn.ModuleDict()).values():
        # Views of the FBGEMM kernel's weights, which its forward never reads: exported, they
        # would be saved beside the kernel's own and double the package (TorchRec 1.8 registers
        # them; a TorchRec without them has nothing to drop).
        view._buffers.pop("weight", None)
    return quantized


def example_inputs(cfg: ModelConfig, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of ``rows`` rows whose bags hold 0 to 2 ids (so that no dimension is 0, 1 or equal
    to another, which ``torch.export`` would take for a constant)."""
    lengths = (torch.arange(rows * cfg.num_sparse_features, dtype=torch.int32) % 3).roll(1)
    values = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    return torch.zeros(rows, cfg.num_dense_features), values, lengths


def export_program(module: Scorer, cfg: ModelConfig) -> ExportedProgram:
    """``module`` exported for any number of rows and ids (non-strict: TorchRec's modules are
    traced as Python runs them)."""
    rows = Dim("rows", min=MIN_ROWS, max=MAX_ROWS)
    ids = Dim("ids", min=0, max=MAX_IDS)
    shapes = ({0: rows}, {0: ids}, {0: rows * cfg.num_sparse_features})
    with quiet_torch(), torch.no_grad():
        return torch.export.export(module, example_inputs(cfg), dynamic_shapes=shapes, strict=False)


def score(module: nn.Module, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``module``'s (a :class:`Scorer` or the program of one) probabilities of the rows given; a
    single row is scored beside an empty one (dense 0, no ids), which the program needs."""
    rows = dense.shape[0]
    if rows >= MIN_ROWS or rows == 0:
        return module(dense, values, lengths)[:rows] if rows else torch.empty(0)
    padded_dense = torch.cat([dense, torch.zeros_like(dense)])
    padded_lengths = torch.stack([lengths, torch.zeros_like(lengths)], dim=1).reshape(-1)  # row 2: no ids
    return module(padded_dense, values, padded_lengths)[:rows]


def table_bytes(program: ExportedProgram) -> int:
    """Bytes of the tables' weights in ``program`` (parameters, buffers and constants of its
    EmbeddingBagCollection), not of the id maps of managed-collision tables (--categorical_ids
    zch), which quantizing leaves as they are."""
    tensors = [*program.state_dict.items(), *program.constants.items()]
    return sum(
        t.numel() * t.element_size()
        for name, t in tensors
        if "embedding_bag_collection" in name
        and "_managed_collision_collection" not in name
        and isinstance(t, torch.Tensor)
    )


#: Loggers of torch that speak of its internals while a program is exported or loaded.
_CHATTY_LOGGERS = ("torch.fx._symbolic_trace", "torch._export.serde.serialize")
#: What TorchRec warns of on the root logger at every export: that exporting its jagged tensors
#: is slow (seconds, once).
_ROOT_WARNING = "Trying to non-strict torch.export KJT to_dict"


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Meanwhile, torch's and TorchRec's log lines about their internals (unused symbols of a
    loaded graph, fx tracing, slow jagged tensors) are dropped; their errors still show."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_ROOT_WARNING)

    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    root = logging.getLogger()
    root.addFilter(keep)
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.removeFilter(keep)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
