"""The held-out splits of click logs stored as a sequence of files, shared by the Criteo source
(:mod:`apps.dlrm.data.criteo.loader`, whose files are days) and the Parquet source
(:mod:`apps.dlrm.data.parquet.loader`)."""

import math

from apps.core.common.errors import ConfigError

Range = tuple[int, int]  # [start, stop) in the rows of all days, in day order


def held_out_split(
    file_rows: list[int],
    eval_days: int,
    eval_fraction: float,
    where: str,
    files: str = "days",
    more: str = "preprocess more days",
) -> dict[str, Range]:
    """The MLPerf-style splits of rows in file order (see :mod:`apps.dlrm.data.criteo.loader`): of the last
    ``eval_days`` files' rows, the last ``eval_fraction`` are held out, the first half (rounded
    up) validating and the rest testing. Shared with the Parquet source, whose files are days.
    Files without rows (Spark writes empty part files) are not days: they hold nothing out."""
    total = sum(file_rows)
    held = int(sum([rows for rows in file_rows if rows][-eval_days:]) * eval_fraction)
    if held < 2 or held >= total:
        fix = (
            "hold out more: raise --eval_fraction or --eval_days"
            if held < 2
            else f"hold out fewer: lower --eval_fraction below 1 or --eval_days, or {more}"
        )
        raise ConfigError(
            f"{where} has {len(file_rows)} {files} ({total:,} rows): --eval_days {eval_days} "
            f"--eval_fraction {eval_fraction} hold out {held:,} rows, which leaves "
            f"{'no validation or test rows' if held < 2 else 'no training rows'}: {fix}"
        )
    val_start = total - held
    test_start = val_start + math.ceil(held / 2)
    return {"train": (0, val_start), "val": (val_start, test_start), "test": (test_start, total)}
