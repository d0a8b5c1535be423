"""Users' event sequences from Parquet files at any fsspec URL, in the layouts public data sets use:

- ``per_user`` (Yambda-style): one row per user, list columns of the events' item ids,
  timestamps and action (event type) ids, one entry per event;
- ``per_event`` (MovieLens-style ratings.csv as Parquet): one row per event (user, item, action,
  timestamp), grouped here per user.

Either way each user's events are sorted by timestamp (stably: events at the same time keep
their file order), and users with fewer than three events (one to train on and the two
leave-last-out targets) are left out. Timestamps are integers (seconds) or Arrow timestamps of
any unit (Spark writes ``timestamp[us]``), which are ordered to their unit and read as seconds
(floored). Every rank reads every file: a user's events may be anywhere in per-event files, and
the users are split among the ranks by batch, not by file.

Each refused input is one line naming the file, the column and the fix: a missing column, a
column of another type, a null (a null event inside a list names its row), lists of a row that
disagree in length, an id outside its table, user ids that are integers in one file and text in
another.
"""

import logging

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from apps.core.common.errors import ConfigError
from apps.core.common.hashing import id_values
from apps.core.data import RankShare
from apps.core.urls import is_url, reaching
from apps.core.zch.config import ZCH
from apps.core.zch.ids import input_ids
from apps.hstu.config import HSTUModelConfig, SequenceDataConfig
from apps.hstu.data import random
from apps.hstu.data.source import MIN_EVENTS, Events, SequenceSource

logger = logging.getLogger(__name__)

PATTERN_CHARS = "*?["


def list_files(data_path: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The filesystem and the Parquet files of ``data_path`` (a file, a folder's .parquet files
    at any depth, names starting with _ or . left out, or a glob), in name order."""
    fs, root = fsspec.core.url_to_fs(data_path)
    with reaching("--data_path", data_path):
        if any(c in root for c in PATTERN_CHARS):
            paths = fs.glob(root)
        elif fs.isdir(root):
            paths = [
                p
                for p in fs.find(root)
                if p.endswith(".parquet") and not any(part.startswith(("_", ".")) for part in p[len(root) :].split("/"))
            ]
        elif fs.exists(root):
            paths = [root]
        else:
            raise ConfigError(f"--data_path {data_path} does not exist: give a Parquet file, folder, glob or URL")
    if not paths:
        raise ConfigError(f"--data_path {data_path} holds no .parquet file: check the path, or give a glob")
    return fs, sorted(paths)


class _Columns:
    """The columns one layout reads: option name -> column name, and what each must hold."""

    def __init__(self, data: SequenceDataConfig) -> None:
        self.per_user = data.layout == "per_user"
        #: Whether the item ids are raw ones (zch), which may be text too.
        self.raw_items = data.categorical_ids == ZCH
        self.names = {"item_column": data.item_column, "timestamp_column": data.timestamp_column}
        if data.action_column:
            self.names["action_column"] = data.action_column
        if not self.per_user:
            self.names["user_column"] = data.user_column

    def check(self, schema: pa.Schema, url: str) -> None:
        for option, name in self.names.items():
            if name not in schema.names:
                raise ConfigError(
                    f"--{option} {name!r} is not a column of {url} (its columns: {', '.join(schema.names)}): "
                    f"give --{option} the column that holds {_WHAT[option]}"
                )
            self._check_type(option, name, schema.field(name).type, url)

    def _check_type(self, option: str, name: str, arrow_type: pa.DataType, url: str) -> None:
        wanted = "a list of integers" if self.per_user else "integers"
        element = arrow_type.value_type if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) else None
        if option == "user_column" or (option == "item_column" and self.raw_items):
            values = element if option == "item_column" and self.per_user else arrow_type
            ok = values is not None and (
                pa.types.is_integer(values) or pa.types.is_string(values) or pa.types.is_large_string(values)
            )
            wanted = (
                "integers or strings"
                if option == "user_column" or not self.per_user
                else "a list of integers or strings"
            )
        elif self.per_user:
            ok = element is not None and _is_integer(element, option)
        else:
            ok = _is_integer(arrow_type, option)
        if not ok:
            other_layout = "per_event" if self.per_user else "per_user"
            if (element is None) == self.per_user and _is_integer(element or arrow_type, option):
                fix = f"give --layout {other_layout} ({_LAYOUTS[other_layout]})"
            else:
                fix = f"convert it ({_WHAT[option]}{', seconds' if option == 'timestamp_column' else ''})"
            raise ConfigError(f"--{option} {name!r} of {url} is {arrow_type}, not {wanted}: {fix}")


_WHAT = {
    "item_column": "the events' item ids",
    "action_column": "the events' action (event type) ids",
    "timestamp_column": "the events' times",
    "user_column": "the events' user ids",
}


_LAYOUTS = {
    "per_user": "one row per user, list columns of its events",
    "per_event": "one row per event, with --user_column",
}


def _is_integer(arrow_type: pa.DataType, option: str) -> bool:
    return pa.types.is_integer(arrow_type) or (option == "timestamp_column" and pa.types.is_timestamp(arrow_type))


def read_events(model: HSTUModelConfig, data: SequenceDataConfig) -> Events:
    """Every user's events in ``--data_path``, sorted by time, users with too few left out; logs
    what was read (files, rows, users, events, columns), as the DLRM's Parquet source does."""
    fs, paths = list_files(data.data_path)
    columns = _Columns(data)
    parts = []
    for path in paths:
        url = fs.unstrip_protocol(path) if is_url(data.data_path) else path
        with reaching("--data_path", data.data_path), fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            columns.check(parquet.schema_arrow, url)
            parts.append((url, parquet.read(columns=list(columns.names.values()))))
    users, items, actions, (times, fractions) = _events(parts, columns, data)
    if data.categorical_ids == ZCH:  # raw ids, into the managed-collision table's input range
        items = input_ids(items)
    else:
        _check_range("item_column", data.item_column, items, model.num_items, "num_items", data.data_path)
    _check_range(
        "action_column",
        columns.names.get("action_column", ""),
        actions,
        model.num_actions,
        "num_actions",
        data.data_path,
    )
    order = np.lexsort((fractions, times, users))  # per user, by time; stable
    _, lengths = np.unique(users[order], return_counts=True)
    item_ids, action_ids, seconds = (torch.from_numpy(a[order]) for a in (items, actions, times))
    events = _enough(Events(item_ids, action_ids, seconds, torch.from_numpy(lengths)), data.data_path)
    logger.info(
        "parquet %s: %d files, %s rows (--layout %s), %s users with %s events; columns read: %s",
        data.data_path,
        len(parts),
        f"{sum(table.num_rows for _, table in parts):,}",
        data.layout,
        f"{events.lengths.numel():,}",
        f"{int(events.lengths.sum()):,}",
        ", ".join(f"{option} {name!r}" for option, name in columns.names.items()),
    )
    return events


def _events(
    parts: list[tuple[str, pa.Table]], columns: _Columns, data: SequenceDataConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The user index, item, action and time of every event, in file order; the time as whole
    seconds and the nanoseconds past them (what orders events within a second)."""
    users, items, actions, times, fractions = [], [], [], [], []
    first_user = 0
    user_ids = _UserIds(columns.names.get("user_column", ""))
    for url, table in parts:
        for option, name in columns.names.items():
            if table[name].null_count:
                raise ConfigError(
                    f"--{option} {name!r} of {url} has {table[name].null_count} nulls: drop or fill those rows"
                )
        if columns.per_user:
            lengths = _list_lengths(table, columns, url)
            users.append(first_user + np.repeat(np.arange(len(lengths)), lengths))
            first_user += len(lengths)
            flat = {option: _flat_events(table[name], option, name, url) for option, name in columns.names.items()}
        else:
            flat = {option: table[name] for option, name in columns.names.items()}
        items.append(_item_ids(flat["item_column"]) if columns.raw_items else _int64(flat["item_column"]))
        second, fraction = _seconds(flat["timestamp_column"])
        times.append(second)
        fractions.append(fraction)
        actions.append(_int64(flat["action_column"]) if "action_column" in flat else np.zeros(len(items[-1]), np.int64))
        if not columns.per_user:
            users.append(user_ids.of(flat["user_column"], url))
    when = np.concatenate(times), np.concatenate(fractions)
    if columns.per_user:
        return np.concatenate(users), np.concatenate(items), np.concatenate(actions), when
    _, user_index = np.unique(np.concatenate(users), return_inverse=True)
    return user_index.astype(np.int64), np.concatenate(items), np.concatenate(actions), when


class _UserIds:
    """Per-event files' user ids, all integers or all text: 7 and "7" would be other users, and
    numpy cannot order the two together, so a file of the other kind is refused, naming both files."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.first: tuple[bool, str] | None = None  # (text, the first file's URL)

    def of(self, ids: pa.ChunkedArray, url: str) -> np.ndarray:
        text = not pa.types.is_integer(ids.type)
        if self.first is None:
            self.first = text, url
        first_text, first_url = self.first
        if text != first_text:
            kinds = {True: "text", False: "integers"}
            raise ConfigError(
                f"--user_column {self.name!r} holds {kinds[text]} in {url} but {kinds[first_text]} in {first_url}: a "
                f"user's id must be of one type in every file; cast it where the files are written (e.g. "
                f"CAST({self.name} AS STRING) in each)"
            )
        return ids.to_numpy()


def _flat_events(lists: pa.ChunkedArray, option: str, name: str, url: str) -> pa.Array:
    """The entries of a per-user list column, one per event, row after row; a null entry is
    refused naming its row (read as a number it would be -2**63: an id, or a time that moves
    the event to the user's start)."""
    combined = lists.combine_chunks()
    flat = pc.list_flatten(combined)
    if flat.null_count:
        entry = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(pc.list_parent_indices(combined)[entry].as_py())
        position = entry - int(combined.offsets[row].as_py())
        raise ConfigError(
            f"row {row} of {url}: --{option} {name!r} holds a null (entry {position} of the row's list; "
            f"{flat.null_count} in all), but every event needs a value there: drop those events, or fill them, "
            "where the files are written"
        )
    return flat


def _list_lengths(table: pa.Table, columns: _Columns, url: str) -> np.ndarray:
    """Events per row: every list column of a row has one entry per event."""
    lengths = {option: pc.list_value_length(table[name]).to_numpy() for option, name in columns.names.items()}
    items = lengths["item_column"]
    for option, other in lengths.items():
        differs = np.nonzero(other != items)[0]
        if differs.size:
            row = int(differs[0])
            raise ConfigError(
                f"row {row} of {url}: --{option} {columns.names[option]!r} has {other[row]} entries but "
                f"--item_column {columns.names['item_column']!r} {items[row]}: each list holds one entry per event"
            )
    return items


def _int64(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(), dtype=np.int64)


def _item_ids(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """int64: raw item ids (zch) as the DLRM's reader takes them, an integer's 64 bits (uint64
    too), a text's FNV-1a 64 fingerprint (:func:`apps.core.common.hashing.id_values`)."""
    values = id_values(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column)
    return values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64)


#: Nanoseconds per unit of an Arrow timestamp.
_UNIT_NS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def _seconds(times: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Whole seconds (floored: before 1970 too) of ``times``, integers taken as seconds or
    Arrow timestamps of any unit, and the nanoseconds past them."""
    if not pa.types.is_timestamp(times.type):
        seconds = _int64(times)
        return seconds, np.zeros_like(seconds)
    per_second = _UNIT_NS["s"] // _UNIT_NS[times.type.unit]
    seconds, rest = np.divmod(_int64(times.cast(pa.int64())), per_second)
    return seconds, rest * _UNIT_NS[times.type.unit]


def _check_range(option: str, name: str, ids: np.ndarray, size: int, size_option: str, data_path: str) -> None:
    if not name or not ids.size:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise ConfigError(
            f"--{option} {name!r} of {data_path} has id {bad}, outside [0, --{size_option} {size}): "
            f"{'set --' + size_option + ' to at least ' + str(high + 1) if low >= 0 else 'remap the ids'} "
            "(ids index the embedding table)"
        )


def _enough(events: Events, data_path: str) -> Events:
    """The users with at least ``MIN_EVENTS`` events."""
    kept = torch.nonzero(events.lengths >= MIN_EVENTS).squeeze(1)
    dropped = events.lengths.numel() - kept.numel()
    if not kept.numel():
        raise ConfigError(
            f"--data_path {data_path}: no user has {MIN_EVENTS} events or more (leave-last-out needs one "
            "to train on, a validation and a test target)"
        )
    if dropped:
        logger.info(
            "%d of %d users have fewer than %d events and are left out", dropped, events.lengths.numel(), MIN_EVENTS
        )
    return events.window(kept, drop_last=0, keep=int(events.lengths.max()))


class ParquetSequences(SequenceSource):
    """The users of Parquet files, each epoch in a new order (a pure function of seed and epoch)."""

    num_users: int

    def __init__(self, model: HSTUModelConfig, data: SequenceDataConfig, share: RankShare) -> None:
        super().__init__(model, data, share)
        self.all = read_events(model, data)
        self.num_users = self.all.lengths.numel()
        self.epoch_steps = max(1, self.num_users // share.global_batch)
        self.steps_per_epoch = self.epoch_steps
        self._order: tuple[int, torch.Tensor] | None = None

    def events(self, users: torch.Tensor) -> Events:
        return self.all.window(users, drop_last=0, keep=int(self.all.lengths.max()))

    def train_users(self, block: int) -> torch.Tensor:
        blocks_per_epoch = self.epoch_steps * self.share.world_size
        epoch, position = divmod(block, blocks_per_epoch)
        batch_size = self.share.batch_size
        return self._epoch_order(epoch)[(position * batch_size + torch.arange(batch_size)) % self.num_users]

    def eval_users(self, block: int) -> torch.Tensor:
        """The users in file order; past the population's end (the padding of the last batches,
        :meth:`SequenceSource.eval_batches`) from its start again."""
        return super().eval_users(block) % self.num_users

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(random.key(self.share.seed, 5, epoch) & ((1 << 63) - 1))
            self._order = (epoch, torch.randperm(self.num_users, generator=generator))
        return self._order[1]
