"""The HSTU app's sequence data: synthetic users (determinism per seed, step and rank; the
leave-last-out split; the exact ceiling against a Monte-Carlo estimate of the Bayes-optimal
predictor) and the Parquet readers of both layouts, with their one-line refusals."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from apps.core.common.errors import ConfigError
from apps.core.data import RankShare
from apps.hstu.config import HSTUModelConfig, SequenceDataConfig
from apps.hstu.data import make_dataset
from apps.hstu.data.batch import SequenceBatch
from apps.hstu.metrics import rank_metrics

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

CPU = torch.device("cpu")


def synthetic(rank=0, world_size=1, seed=0, batch_size=8, **data):
    model = HSTUModelConfig(num_items=40, max_seq_len=12)
    return make_dataset(model, SequenceDataConfig(**data), RankShare(rank, world_size, seed, batch_size), CPU)


def sequences(batch: SequenceBatch) -> list[list[tuple[int, int, int]]]:
    """Each user's (item, action, time) events."""
    items = batch.features["item"].values().tolist()
    actions = batch.features["action"].values().tolist()
    times = batch.timestamps.tolist()
    out, start = [], 0
    for length in batch.features["item"].lengths().tolist():
        out.append(
            list(zip(items[start : start + length], actions[start : start + length], times[start : start + length]))
        )
        start += length
    return out


def same(a: SequenceBatch, b: SequenceBatch) -> bool:
    return sequences(a) == sequences(b) and torch.equal(a.features.values(), b.features.values())


def test_synthetic_batches_are_a_pure_function_of_seed_step_and_rank():
    first = list(zip(range(4), synthetic(rank=1, world_size=2).train_batches()))
    again = synthetic(rank=1, world_size=2).train_batches(start_step=2)  # a resumed run, another object
    assert same(next(again), first[2][1])
    assert not same(first[0][1], next(synthetic(rank=0, world_size=2).train_batches()))
    assert not same(first[0][1], next(synthetic(rank=1, world_size=2, seed=1).train_batches()))
    # ranks split the users of a step: rank r of 2 reads block 2 * step + r, as one process does
    single = synthetic(batch_size=8)
    assert same(first[1][1], single.batch("train", 3))


def ends_alike(a: list, b: list) -> bool:
    """Whether the shorter is the end of the longer (a window keeps a user's last events)."""
    n = min(len(a), len(b))
    return n > 0 and a[-n:] == b[-n:]


def test_synthetic_users_are_split_leave_last_out():
    source = synthetic(batch_size=16)
    train, val, test = (sequences(source.batch(split, 0)) for split in ("train", "val", "test"))
    for user_train, user_val, user_test in zip(train, val, test):
        assert ends_alike(user_test[:-1], user_val)  # the test target follows the validation target
        assert ends_alike(user_val[:-1], user_train)  # which follows the training events
        assert len(user_test) <= 12 and len(user_train) >= 1
        assert [t for _, _, t in user_test] == sorted(t for _, _, t in user_test)


def test_synthetic_negatives_leave_out_the_evaluation_target():
    batch = synthetic(eval_negatives=39).batch("val", 0)
    negatives = batch.features["negative_item"].values().view(8, 39)
    targets = batch.features["item"].values()[torch.cumsum(batch.features["item"].lengths(), 0) - 1]
    assert not (negatives == targets[:, None]).any()


@pytest.mark.parametrize("eval_negatives", [0, 6])
def test_the_ceiling_is_what_the_bayes_optimal_predictor_reaches(eval_negatives):
    """The exact ceiling against the mean over 6000 users of the predictor that scores each
    candidate by the true P(next | last item) and breaks ties at random."""
    model = HSTUModelConfig(num_items=30, max_seq_len=6)
    data = SequenceDataConfig(synthetic_branching=3, synthetic_noise=0.3, eval_negatives=eval_negatives)
    source = make_dataset(model, data, RankShare(0, 1, seed=3, batch_size=2000), CPU)
    generator = torch.Generator().manual_seed(0)
    per_user = []
    for block in range(3):
        batch = source.batch("test", block)
        ends = torch.cumsum(batch.features["item"].lengths(), 0)
        items = batch.features["item"].values()
        probabilities = source.process.transition_probabilities(items[ends - 2])
        if eval_negatives:
            candidates = batch.features["negative_item"].values().view(-1, eval_negatives)
        else:
            candidates = torch.arange(30).expand(len(ends), -1)
        scores = probabilities.gather(1, candidates)
        target = probabilities.gather(1, items[ends - 1][:, None])
        others = candidates != items[ends - 1][:, None]
        higher = ((scores > target) & others).sum(1)
        tied = ((scores == target) & others).sum(1)
        tie_break = (torch.rand(len(ends), generator=generator, dtype=torch.float64) * (tied + 1)).floor().long()
        per_user.append(rank_metrics(1 + higher + tie_break, 10))
    ceiling = source.ceiling()
    for name, expected in ceiling.items():
        values = torch.cat([m[name] for m in per_user])
        error = values.std().item() / len(values) ** 0.5
        assert abs(values.mean().item() - expected) < 4 * error + 1e-9, (name, values.mean().item(), expected)


EVENTS = [  # (user, item, action, time): user "b" has 2 events, too few for leave-last-out
    ("a", 5, 1, 100),
    ("c", 7, 0, 50),
    ("a", 3, 0, 40),
    ("b", 1, 2, 10),
    ("c", 9, 2, 60),
    ("a", 8, 2, 300),
    ("c", 2, 1, 70),
    ("b", 4, 1, 20),
    ("a", 6, 1, 200),
    ("c", 1, 1, 80),
]
#: Each kept user's (item, action, time) events sorted by time: users a and c.
EXPECTED = [
    [(3, 0, 40), (5, 1, 100), (6, 1, 200), (8, 2, 300)],
    [(7, 0, 50), (9, 2, 60), (2, 1, 70), (1, 1, 80)],
]


def write_per_event(path, rows=EVENTS, **types):
    columns = list(zip(*rows))
    table = pa.table(
        {
            "user": pa.array(columns[0]),
            "movie": pa.array(columns[1], types.get("movie", pa.int64())),
            "rating": pa.array(columns[2], types.get("rating", pa.int8())),
            "ts": pa.array(columns[3], types.get("ts", pa.int64())),
        }
    )
    pq.write_table(table, path)


def write_per_user(path, rows=EVENTS, **types):
    users = sorted({user for user, *_ in rows})
    per_user = {column: [] for column in ("item_id", "event_type", "timestamp")}
    for user in users:
        events = [event for event in rows if event[0] == user]  # file order: not sorted by time
        for column, index in zip(per_user, (1, 2, 3)):
            per_user[column].append([event[index] for event in events])
    table = pa.table(
        {
            "uid": pa.array(users),
            "item_id": pa.array(per_user["item_id"], types.get("item_id", pa.list_(pa.int32()))),
            "event_type": pa.array(per_user["event_type"], pa.list_(pa.int64())),
            "timestamp": pa.array(per_user["timestamp"], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, path)


def parquet(path, layout, batch_size=2, rank=0, world_size=1, **options):
    defaults = {
        "per_event": dict(user_column="user", item_column="movie", action_column="rating", timestamp_column="ts")
    }
    data = SequenceDataConfig(
        data="parquet", data_path=str(path), layout=layout, **{**defaults.get(layout, {}), **options}
    )
    data.check()
    share = RankShare(rank, world_size, seed=0, batch_size=batch_size)
    return make_dataset(HSTUModelConfig(num_items=10, num_actions=3), data, share, CPU)


@pytest.mark.parametrize("layout", ["per_user", "per_event"])
def test_both_layouts_give_each_users_events_sorted_by_time(tmp_path, layout):
    (write_per_user if layout == "per_user" else write_per_event)(tmp_path / "part-0.parquet")
    source = parquet(tmp_path, layout)
    assert sequences(source.batch("test", 0)) == EXPECTED
    assert sequences(source.batch("val", 0)) == [events[:-1] for events in EXPECTED]
    assert source.steps_per_epoch == 1
    assert sorted(map(tuple, sequences(next(source.train_batches())))) == sorted(tuple(e[:-2]) for e in EXPECTED)


def test_per_event_files_are_read_together_and_timestamps_may_be_arrow_timestamps(tmp_path):
    write_per_event(tmp_path / "a.parquet", EVENTS[:5], ts=pa.timestamp("s"))
    write_per_event(tmp_path / "b.parquet", EVENTS[5:], ts=pa.timestamp("s"))
    assert sequences(parquet(tmp_path, "per_event").batch("test", 0)) == EXPECTED


def test_parquet_logs_what_it_read_at_start(tmp_path, caplog):
    write_per_event(tmp_path / "a.parquet", EVENTS[:5])
    write_per_event(tmp_path / "b.parquet", EVENTS[5:])
    with caplog.at_level(logging.INFO, logger="apps.hstu.data.parquet"):
        parquet(tmp_path, "per_event")
    summary = (
        f"parquet {tmp_path}: 2 files, 10 rows (--layout per_event), 2 users with 8 events; columns read: "
        "item_column 'movie', timestamp_column 'ts', action_column 'rating', user_column 'user'"
    )
    assert summary in caplog.messages  # user "b" has too few events: left out of the users


def test_parquet_is_read_from_an_fsspec_url(tmp_path):
    import fsspec

    write_per_user(tmp_path / "users.parquet")
    with fsspec.open("memory://hstu/users.parquet", "wb") as f:
        f.write((tmp_path / "users.parquet").read_bytes())
    assert sequences(parquet("memory://hstu/", "per_user").batch("test", 0)) == EXPECTED


def test_parquet_epochs_visit_every_user_once_in_a_new_order_per_epoch(tmp_path):
    rows = [(f"u{u}", (u + t) % 10, t % 3, 1000 * u + t) for u in range(12) for t in range(3)]
    write_per_event(tmp_path / "events.parquet", rows)
    ranks = [parquet(tmp_path, "per_event", batch_size=3, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == 2

    def users_read(source, steps: range) -> list[int]:
        """The users of the training steps ``steps``, by their first event's time (1000 * user)."""
        return [
            user[0][2] // 1000
            for step in steps
            for user in sequences(source.batch("train", 2 * step + source.share.rank))
        ]

    assert sorted(users_read(ranks[0], range(2)) + users_read(ranks[1], range(2))) == list(range(12))
    assert sorted(users_read(ranks[0], range(2, 4)) + users_read(ranks[1], range(2, 4))) == list(range(12))
    assert users_read(ranks[0], range(2)) != users_read(ranks[0], range(2, 4))  # epoch 2 in another order


@pytest.mark.parametrize(
    "write, options, message",
    [
        (
            write_per_event,
            dict(item_column="item"),
            "--item_column 'item' is not a column of .*events.parquet \\(its columns: user, movie, rating, ts\\)",
        ),
        (
            lambda p: write_per_event(p, rating=pa.float32()),
            dict(),
            "--action_column 'rating' of .* is float, not integers",
        ),
        (
            lambda p: write_per_event(p, [*EVENTS, ("d", 10, 0, 1)]),
            dict(),
            "--item_column 'movie' of .* has id 10, outside \\[0, --num_items 10\\): set --num_items to at least 11",
        ),
        (lambda p: write_per_event(p, [*EVENTS, ("d", -1, 0, 1)]), dict(), "has id -1, outside .*: remap the ids"),
        (
            lambda p: write_per_event(p, [*EVENTS, ("d", None, 0, 1)]),
            dict(),
            "--item_column 'movie' of .* has 1 nulls: drop or fill those rows",
        ),
        (lambda p: write_per_event(p, EVENTS[:3]), dict(), "no user has 3 events or more"),
    ],
)
def test_bad_parquet_is_refused_in_one_line_naming_the_column_and_the_fix(tmp_path, write, options, message):
    path = tmp_path / "events.parquet"
    write(path)
    with pytest.raises(ConfigError, match=message) as refused:
        parquet(path, "per_event", **options)
    assert "\n" not in str(refused.value)


def test_per_user_columns_must_be_lists_of_integers(tmp_path):
    table = pa.table({"item_id": [["1", "2", "3"]], "event_type": [[0, 1, 2]], "timestamp": [[1, 2, 3]]})
    pq.write_table(table, tmp_path / "u.parquet")
    with pytest.raises(
        ConfigError, match="^--item_column 'item_id' of .* is list<element: string>, not a list of integers"
    ):
        parquet(tmp_path, "per_user")


def test_per_user_lists_of_a_row_must_agree_in_length(tmp_path):
    table = pa.table({"item_id": [[1, 2, 3]], "event_type": [[0, 1, 2]], "timestamp": [[1, 2]]})
    pq.write_table(table, tmp_path / "u.parquet")
    with pytest.raises(
        ConfigError,
        match="row 0 of .*u.parquet: --timestamp_column 'timestamp' has 2 entries but --item_column 'item_id' 3",
    ):
        parquet(tmp_path, "per_user")


def test_a_missing_data_path_is_refused():
    with pytest.raises(ConfigError, match="^--data_path /nonexistent/x does not exist"):
        parquet("/nonexistent/x", "per_user")


@pytest.mark.parametrize("written, read", [("per_event", "per_user"), ("per_user", "per_event")])
def test_a_file_of_the_other_layout_is_refused_naming_it(tmp_path, written, read):
    events = {"item_id": [1, 2, 3], "event_type": [0, 1, 2], "timestamp": [1, 2, 3]}
    if written == "per_user":
        table = pa.table({name: [values] for name, values in events.items()})
    else:
        table = pa.table({"uid": [7, 7, 7], **events})
    pq.write_table(table, tmp_path / "u.parquet")
    with pytest.raises(ConfigError, match=f"^--item_column 'item_id' of .*: give --layout {written} "):
        parquet(
            tmp_path,
            read,
            user_column="uid",
            item_column="item_id",
            action_column="event_type",
            timestamp_column="timestamp",
        )


@pytest.mark.parametrize("column, option", [("timestamp", "timestamp"), ("item_id", "item"), ("event_type", "action")])
def test_a_null_event_inside_a_users_lists_is_refused_naming_its_row(tmp_path, column, option):
    """Read as a number a null was -2**63: a time that moved the event to the user's start, an id."""
    lists = {
        "item_id": [[1, 2, 3], [4, 5, 6]],
        "event_type": [[0, 1, 2], [0, 1, 2]],
        "timestamp": [[1, 2, 3], [4, 5, 6]],
    }
    lists[column][1][1] = None
    pq.write_table(pa.table(lists), tmp_path / "u.parquet")
    with pytest.raises(ConfigError) as refused:
        parquet(tmp_path, "per_user")
    assert str(refused.value).startswith(
        f"row 1 of {tmp_path / 'u.parquet'}: --{option}_column {column!r} holds a null (entry 1 of the row's list; 1 in "
        "all), but every event needs a value there: drop those events, or fill them, where the files are written"
    )


@pytest.mark.parametrize("unit", ["ms", "us"])
def test_arrow_timestamps_of_any_unit_are_ordered_to_their_unit_and_read_as_seconds(tmp_path, unit):
    """As Spark writes them: timestamp[us]. Two of user c's events fall within one second, the
    later first in the file."""
    per_second = {"ms": 1_000, "us": 1_000_000}[unit]
    rows = [(user, item, action, time * per_second) for user, item, action, time in EVENTS]
    rows[6] = ("c", 2, 1, 70 * per_second + per_second // 2)  # 70.5 s, before 70.2 s in the file
    rows.append(("c", 4, 0, 70 * per_second + per_second // 5))
    expected = [EXPECTED[0], [(7, 0, 50), (9, 2, 60), (4, 0, 70), (2, 1, 70), (1, 1, 80)]]
    write_per_event(tmp_path / "events.parquet", rows, ts=pa.timestamp(unit))
    assert sequences(parquet(tmp_path, "per_event").batch("test", 0)) == expected
    users = sorted({user for user, *_ in rows})
    events = [[event for event in rows if event[0] == user] for user in users]
    table = pa.table(
        {
            "item_id": [[e[1] for e in user] for user in events],
            "event_type": [[e[2] for e in user] for user in events],
            "timestamp": pa.array([[e[3] for e in user] for user in events], pa.list_(pa.timestamp(unit, tz="UTC"))),
        }
    )
    pq.write_table(table, tmp_path / "events.parquet")
    assert sequences(parquet(tmp_path, "per_user").batch("test", 0)) == expected


def test_user_ids_that_are_integers_in_one_file_and_text_in_another_are_refused_naming_both(tmp_path):
    write_per_event(tmp_path / "a.parquet", [(1, 5, 1, 100), (1, 3, 0, 40), (1, 8, 2, 300)])
    write_per_event(tmp_path / "b.parquet", EVENTS)
    with pytest.raises(ConfigError) as refused:
        parquet(tmp_path, "per_event")
    assert str(refused.value).startswith(
        f"--user_column 'user' holds text in {tmp_path / 'b.parquet'} but integers in {tmp_path / 'a.parquet'}: a "
        "user's id must be of one type in every file; cast it where the files are written (e.g. CAST(user AS STRING)"
    )


def test_evaluation_reads_each_user_once_in_full_batches_whose_padding_is_marked(tmp_path):
    """5 users, 2 ranks of 2: two rounds, the second holding one user (rank 0's first) and padding."""
    rows = [(f"u{u}", u, t % 3, 1000 * u + t) for u in range(5) for t in range(3)]
    write_per_event(tmp_path / "events.parquet", rows)
    ranks = [parquet(tmp_path, "per_event", batch_size=2, rank=r, world_size=2) for r in range(2)]

    def counted(num_batches: int) -> list[list[int]]:
        """Per rank, the users (by item) of each batch that count, and every batch is full."""
        read = []
        for source in ranks:
            batches = list(source.eval_batches("val", num_batches))
            assert all(batch.num_users == 2 for batch in batches)
            read.append([user[-1][0] for batch in batches for user in sequences(batch)[: batch.counted]])
        return read

    assert counted(0) == counted(40) == [[0, 1, 4], [2, 3]]  # all of them, each once
    assert counted(1) == [[0, 1], [2, 3]]
