"""Parquet click logs that a DLRM can learn, for the tests and benchmarks of training, export and
prediction: the synthetic click logs (:mod:`apps.dlrm.data.synthetic`, labels drawn from a hidden
teacher) written as files with the columns ``--data parquet`` reads by default (``label``,
``int_0`` ... , ``cat_0`` ...) and a ``row_id`` that numbers the rows across files, for joining
predictions back to their rows.
"""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from apps.core.data import RankShare
from apps.dlrm.config import train_config
from apps.dlrm.data.synthetic import SyntheticClickLogs


def write_click_parquet(
    folder: str,
    files: int = 4,
    rows_per_file: int = 4096,
    row_group_rows: int = 1024,
    num_embeddings: int = 2000,
    seed: int = 0,
    dense_counts: bool = False,
    text_columns: tuple[int, ...] = (),
) -> str:
    """Writes ``files`` files of ``rows_per_file`` rows into ``folder`` (``day_0.parquet``, ...);
    returns the folder. The sparse columns hold the synthetic ids (rows of tables of
    ``num_embeddings``) as int64 values, which training hashes (or takes as they are).
    ``dense_counts``: the dense values x (standard normal) written as raw counts would be,
    exp(x + 3) - 1 (up to thousands), which ``--dense_transform log1p`` reads back as x + 3.
    ``text_columns``: the sparse columns whose ids are written as text, ``"id<n>"`` (as user ids
    often come), which ``--categorical_ids hash`` fingerprints."""
    cfg = train_config(num_embeddings=num_embeddings, batch_size=rows_per_file, seed=seed)
    logs = SyntheticClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training))
    os.makedirs(folder, exist_ok=True)
    for f in range(files):
        batch = logs.block("train", f)
        ids = batch.sparse_features.values().view(cfg.model.num_sparse_features, rows_per_file).numpy()
        dense = batch.dense_features.numpy().T
        columns = {
            "row_id": pa.array(np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64)),
            "label": pa.array(batch.labels.numpy().astype(np.int8)),
            **{
                f"int_{j}": pa.array(np.expm1(column + 3) if dense_counts else column) for j, column in enumerate(dense)
            },
            **{
                f"cat_{k}": pa.array([f"id{n}" for n in column] if k in text_columns else column.astype(np.int64))
                for k, column in enumerate(ids)
            },
        }
        pq.write_table(pa.table(columns), os.path.join(folder, f"day_{f}.parquet"), row_group_size=row_group_rows)
    return folder


def scores_auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The AUROC of ``scores`` against ``labels``, as the app's validation computes it (torchmetrics)."""
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.tensor(scores), torch.tensor(labels).int()))
