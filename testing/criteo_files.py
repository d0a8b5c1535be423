"""Criteo-format click logs that the tests generate, with what preprocessing must make of them.

Real Criteo rows may not be redistributed, so every test writes its own: lines of 40 tab-separated
fields (label, 13 integers, 26 8-hex-digit values; any feature may be empty), with every kind of
malformed line mixed in. Each generated day carries the arrays and counts that preprocessing must
produce from it, computed here independently of the code under test.
"""

import gzip
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

INT_FEATURES = 13
CAT_FEATURES = 26

# Malformed lines and fields, by the kind the report counts them under. Lines are text; bytes
# that are not UTF-8 are written from surrogates ("\udcff" is the byte 0xff).
BAD_LINES = {
    "undecodable": [
        "\x1b[31m\udcff\udcfe binary garbage",  # a terminal escape code, then bytes that are not UTF-8
        "BINARY_FIELD",  # 40 fields, one of them not UTF-8
    ],
    "empty_line": [""],
    "wrong_column_count": [
        "TOO_FEW",  # 39 fields: a line of the unlabelled Kaggle test set
        "TOO_MANY",  # 41 fields
        "garbage without tabs",
        "TRUNCATED",  # a line cut off in the middle
    ],
    "bad_label": ["2", "x", "", "-1", "1.0", " 1", "01"],
}
BAD_INTEGERS = ["abc", "1.5", "+3", "0x1f", "1e3", "99999999999999999999", "--1", "-", "1-2", " 7"]
BAD_CATEGORICALS = ["xyz12345", "abc", "123456789", "0x123456", "ghijklmn", "1234567 "]


@dataclass
class Day:
    """A generated day file and what preprocessing must make of it."""

    lines: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    ints: list[list[int]] = field(default_factory=list)  # missing and repaired: 0
    cats: list[list[int]] = field(default_factory=list)  # 32-bit values; missing and repaired: 0
    skipped: Counter = field(default_factory=Counter)
    repaired: Counter = field(default_factory=Counter)

    @property
    def rows_written(self) -> int:
        return len(self.labels)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.array(self.labels, dtype=np.int32),
            np.array(self.ints, dtype=np.int64).reshape(-1, INT_FEATURES),
            np.array(self.cats, dtype=np.uint32).reshape(-1, CAT_FEATURES),
        )


def generate_day(rows: int, seed: int, malformed: bool = True, cat_pool: int = 300) -> Day:
    """``rows`` valid lines (labels, negative and missing integers, missing and repeated
    categorical values) and, with ``malformed``, every bad kind, each a few times."""
    rng = np.random.default_rng(seed)
    day = Day()
    # A shared pool of values per feature, drawn with a heavy tail: some values are frequent,
    # many are rare (what a vocabulary threshold is about).
    pool = rng.integers(0, 2**32, size=(CAT_FEATURES, cat_pool), dtype=np.uint64)
    bad_positions = {}
    if malformed:
        kinds = [(kind, text) for kind, texts in BAD_LINES.items() for text in texts]
        kinds += [("bad_integer", text) for text in BAD_INTEGERS]
        kinds += [("bad_categorical", text) for text in BAD_CATEGORICALS]
        kinds += [("bad_integer_and_categorical", "")]
        for i, kind in enumerate(kinds * 2):
            bad_positions[int(rng.integers(0, rows + 1)) * 1000 + i] = kind
    bad_iter = iter(sorted(bad_positions.items()))
    next_bad = next(bad_iter, None)
    for r in range(rows + 1):
        while next_bad is not None and next_bad[0] // 1000 == r:
            _add_bad(day, rng, pool, *next_bad[1])
            next_bad = next(bad_iter, None)
        if r < rows:
            _add_valid(day, rng, pool)
    return day


def _valid_fields(rng, pool) -> tuple[int, list[int | None], list[int | None]]:
    ints: list[int | None] = []
    for j in range(INT_FEATURES):
        if rng.random() < 0.15:
            ints.append(None)
        else:
            value = int(np.floor(rng.lognormal(1.0, 2.0)))
            ints.append(value - 3 if j == 1 else value)  # Criteo's I2 goes negative
    cats: list[int | None] = []
    for j in range(CAT_FEATURES):
        if rng.random() < 0.1:
            cats.append(None)
        else:
            cats.append(int(pool[j, min(int(rng.zipf(1.5)) - 1, pool.shape[1] - 1)]))
    # Clicks depend on the first categorical feature and the first integer feature, so a model
    # that gets each sample's own features and label can learn them (and one that got them
    # misaligned could not).
    logit = -1.0 + (2.0 if (cats[0] or 0) % 3 == 0 else -1.0) + 0.5 * np.log1p(max(ints[0] or 0, 0))
    label = int(rng.random() < 1.0 / (1.0 + np.exp(-logit)))
    return label, ints, cats


def _format(label: str, ints, cats, rng) -> list[str]:
    fields = [label]
    fields += ["" if v is None else str(v) for v in ints]
    # Criteo writes lowercase; uppercase hex is read the same way.
    fields += ["" if v is None else ("%08X" if rng.random() < 0.02 else "%08x") % v for v in cats]
    return fields


def _record(day: Day, label: int, ints, cats) -> None:
    day.labels.append(label)
    day.ints.append([v or 0 for v in ints])
    day.cats.append([v or 0 for v in cats])


def _add_valid(day: Day, rng, pool) -> None:
    label, ints, cats = _valid_fields(rng, pool)
    day.lines.append("\t".join(_format(str(label), ints, cats, rng)))
    _record(day, label, ints, cats)


def _add_bad(day: Day, rng, pool, kind: str, text: str) -> None:
    label, ints, cats = _valid_fields(rng, pool)
    fields = _format(str(label), ints, cats, rng)
    if kind == "undecodable":
        fields[1 + INT_FEATURES] = "\udcff\udcfe123456"
        day.lines.append("\t".join(fields) if text == "BINARY_FIELD" else text)
    elif kind == "empty_line":
        day.lines.append("")
    elif kind == "wrong_column_count":
        line = {
            "TOO_FEW": "\t".join(fields[1:]),
            "TOO_MANY": "\t".join(fields + ["5"]),
            "TRUNCATED": "\t".join(fields)[: len("\t".join(fields)) // 2],
        }.get(text, text)
        day.lines.append(line)
    elif kind == "bad_label":
        day.lines.append("\t".join([text] + fields[1:]))
    elif kind == "bad_integer":
        j = int(rng.integers(0, INT_FEATURES))
        fields[1 + j] = text
        ints[j] = None
        day.lines.append("\t".join(fields))
        _record(day, label, ints, cats)
    elif kind == "bad_categorical":
        j = int(rng.integers(0, CAT_FEATURES))
        fields[1 + INT_FEATURES + j] = text
        cats[j] = None
        day.lines.append("\t".join(fields))
        _record(day, label, ints, cats)
    elif kind == "bad_integer_and_categorical":  # counted once, under the first kind
        fields[1], fields[1 + INT_FEATURES] = "x", "y"
        ints[0], cats[0] = None, None
        day.lines.append("\t".join(fields))
        _record(day, label, ints, cats)
        kind = "bad_integer"
    if kind in BAD_LINES:
        day.skipped[kind] += 1
    else:
        day.repaired[kind] += 1


def write_day(day: Day, path: str, compress: bool = False, newline: str = "\n", final_newline: bool = True) -> str:
    text = newline.join(day.lines) + (newline if final_newline else "")
    data = text.encode("utf-8", "surrogateescape")
    if compress:
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def expected_dense(ints: np.ndarray) -> np.ndarray:
    """The documented transform, written out here independently: log(1 + max(x, 0))."""
    return np.log1p(np.clip(ints, 0, None).astype(np.float64)).astype(np.float32)
