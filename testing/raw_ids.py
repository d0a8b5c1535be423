"""Parquet click logs of raw ids with a planted signal, for the tests and the figure of
``--categorical_ids zch`` (docs/data.md): what users' own logs carry, ids from huge spaces
(50-bit integers, text), popular by a power law.

Each sparse column ``cat_k`` draws its rows' ids from a vocabulary of ``distinct`` raw ids, the
i-th most popular with weight 1 / (i + 1)^``zipf_exponent``; integer columns hold random 50-bit
ids, text columns ``"u"`` and 13 hex digits of one. Every id has its own effect on the click, drawn
N(0, ``id_effect``), so a model learns a row per id best: rows an id shares with others (hashing's
collisions, or a managed-collision table's shared default row) blur it. The label is a draw of
sigmoid(``bias`` + the effects of the row's ids + 0.5 x its dense values' sum). The last file is
what ``--eval_days 1`` holds out.
"""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

#: Bits of the integer ids (as the issue's figure had them: ids from a space of a quadrillion).
ID_BITS = 50


def write_raw_id_parquet(
    folder: str,
    rows: int = 8192,
    files: int = 4,
    columns: int = 3,
    distinct: int = 2000,
    text_columns: tuple[int, ...] = (2,),
    dense_columns: int = 2,
    zipf_exponent: float = 1.05,
    id_effect: float = 1.0,
    bias: float = -1.0,
    seed: int = 0,
    row_group_rows: int = 4096,
) -> dict[str, np.ndarray]:
    """Writes ``rows`` rows in ``files`` files (``day_0.parquet``, ...) into ``folder``; returns the
    vocabularies (per column, the raw ids by popularity: text columns' as strings)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, distinct + 1) ** zipf_exponent
    popularity /= popularity.sum()
    logit = np.full(rows, bias)
    sparse, vocabularies = {}, {}
    for k in range(columns):
        raw = rng.choice(2**ID_BITS, size=distinct, replace=False).astype(np.int64)
        drawn = rng.choice(distinct, size=rows, p=popularity)
        logit += rng.normal(0.0, id_effect, distinct)[drawn]
        vocabulary = np.array([f"u{v:013x}" for v in raw]) if k in text_columns else raw
        vocabularies[f"cat_{k}"] = vocabulary
        sparse[f"cat_{k}"] = pa.array(vocabulary[drawn])
    dense = rng.standard_normal((dense_columns, rows)).astype(np.float32)
    logit += 0.5 * dense.sum(axis=0)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    table = pa.table(
        {
            "label": pa.array(labels),
            **{f"int_{j}": pa.array(column) for j, column in enumerate(dense)},
            **sparse,
        }
    )
    os.makedirs(folder, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for f in range(files):
        part = table.slice(bounds[f], bounds[f + 1] - bounds[f])
        pq.write_table(part, os.path.join(folder, f"day_{f}.parquet"), row_group_size=row_group_rows)
    return vocabularies
