"""A training run's checkpoint into an inference package (``components.dlrm:export``).

The checkpoint that ``--step`` names is loaded whole into this process (any sharding and world
size: :mod:`apps.dlrm.serving.trained`), its tables quantized if asked, the model exported with
``torch.export`` (:mod:`apps.dlrm.serving.program`) and written with its manifest
(:mod:`apps.dlrm.serving.package`). The manifest records what serving the program needs: the
features (columns, their order, the tables' sizes, how values become table rows and how dense
values are read), the model's options, the training run's configuration and validations, the
source checkpoint with the SHA-256 of the weights taken from it, the tables' size before and after
quantization, and the versions of torch, TorchRec and FBGEMM that exported it.
"""

import datetime
import logging
import time
from typing import Any

from apps.core.checkpoint.checkpointer import package_versions
from apps.core.options import option_values
from apps.core.urls import redact_urls
from apps.dlrm.serving.config import ExportConfig
from apps.dlrm.serving.features import Features
from apps.dlrm.serving.package import check_place, manifest_record, write_package
from apps.dlrm.serving.program import export_program, quantize_tables, scorer, table_bytes
from apps.dlrm.serving.trained import Trained, load_trained

logger = logging.getLogger("apps.dlrm.serving")

#: The program's inputs and output, in words, for whoever serves it without this project.
PROGRAM_SIGNATURE = {
    "kind": "torch.export",
    "load": "torch.export.load(path).module(); import torchrec (or fbgemm_gpu) first for fp16/int8 tables",
    "inputs": {
        "dense": "float32 [rows, num_dense_features]: the dense features, transformed as dense_transform says",
        "values": "int64 [ids]: the rows' table rows of feature keys[0], then of keys[1], ...",
        "lengths": "int32 [num_sparse_features * rows]: ids per row of keys[0] (row after row), then of keys[1], ...",
    },
    "output": "float32 [rows]: the click probability (sigmoid of the DLRM's logit)",
    "rows": "2 or more: score a single row beside an empty one (dense 0, no ids)",
}


def export(cfg: ExportConfig) -> dict[str, Any]:
    """Writes the package of the checkpoint ``cfg`` names; returns its manifest."""
    start = time.perf_counter()
    check_place(cfg.output)  # before the minutes of loading; written atomically, checked again then
    trained = load_trained(cfg.checkpoint_dir, cfg.step)
    features = Features.of(trained.cfg, trained.columns)
    trained_bytes = sum(p.numel() * p.element_size() for p in trained.model.sparse_arch.parameters())
    quantize_tables(trained.model, cfg.quantize)
    program = export_program(scorer(trained.model, trained.cfg.model), trained.cfg.model)
    tables = {"quantize": cfg.quantize, "trained_bytes": trained_bytes, "package_bytes": table_bytes(program)}
    manifest = write_package(cfg.output, program, _manifest(trained, features, tables))
    seconds = time.perf_counter() - start
    reduction = f" ({trained_bytes / tables['package_bytes']:.2f}x smaller)" if cfg.quantize != "none" else ""
    logger.info(
        "exported %s (step %d) to %s in %.1f s: tables %s %.1f MB%s, program %.1f MB",
        redact_urls(trained.checkpoint.url),
        trained.checkpoint.step,
        redact_urls(cfg.output),
        seconds,
        cfg.quantize if cfg.quantize != "none" else "float32",
        tables["package_bytes"] / 1e6,
        reduction,
        manifest["program"]["bytes"] / 1e6,
    )
    return manifest


def _manifest(trained: Trained, features: Features, tables: dict[str, Any]) -> dict[str, Any]:
    progress = trained.checkpoint.manifest.get("progress", {})
    return manifest_record(
        program=PROGRAM_SIGNATURE,
        features=features.record(),
        tables=tables,
        model=option_values(trained.cfg.model) | {"table_sizes": trained.cfg.model.table_sizes},
        training={
            "run_id": trained.checkpoint.manifest.get("run_id"),
            "step": trained.checkpoint.step,
            "train_loss": progress.get("train_loss"),
            "validations": progress.get("validations", {}),
            "config": trained.checkpoint.manifest["config"],
        },
        source=trained.source,
        versions=package_versions(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
