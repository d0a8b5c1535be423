"""A checkpoint written under any sharding type resumes under any other, on any world size: the
tables equal, and the optimizer state equal (exact) or the documented estimate (README:
Checkpoints and resuming).

Real torchrun runs of the app on CPU, of a tiny model whose 4 tables have 256 columns, so that
column-wise sharding splits each into 2 column shards (TorchRec's minimum shard is 128 columns).
Three launches do it all: training on 2 ranks under every sharding type; training on 1 rank and
resuming there; resuming on 2 ranks. Each resume dumps every tensor of the model and optimizer
as its ranks hold them; the test puts them together and compares them with the checkpoint.
"""

import itertools
import json

import pytest
import torch

from apps.core.checkpoint.reshard import ColumnMap, StateKey, column_map, parse_key
from apps.core.common.tables import Tables
from apps.dlrm.model import TABLES as DLRM_TABLES
from tests.conftest import REPO, assert_ok, torchrun
from tests.shards import assemble, saved_tensors

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
ROWS = {"t_cat_0": 101, "t_cat_1": 64, "t_cat_2": 80, "t_cat_3": 50}  # 101: uneven row shards
STEPS = 3
STEP_DIR = f"step_{STEPS:08d}"
MODEL = [
    "--num_sparse_features",
    "4",
    "--num_embeddings_per_feature",
    ",".join(map(str, ROWS.values())),
    "--embedding_dim",
    "256",
    "--dense_arch_layer_sizes",
    "16,256",
    "--over_arch_layer_sizes",
    "16,1",
    "--batch_size",
    "32",
    "--steps",
    str(STEPS),
    "--log_every",
    str(STEPS),
    "--val_batches",
    "1",
    "--test_batches",
    "1",
]

#: (embedding optimizer, ranks) -> the sharding types checkpoints are written under
SAVED = {
    ("rowwise_adagrad", 2): TYPES,
    ("rowwise_adagrad", 1): TYPES,
    ("adagrad", 2): TYPES,
    ("sgd", 2): ("column_wise", "data_parallel"),
}
#: (embedding optimizer, ranks) -> the ranks whose checkpoints are resumed there under every type
RESUMED = {
    ("rowwise_adagrad", 2): (2, 1),
    ("rowwise_adagrad", 1): (2,),
    ("adagrad", 2): (2,),
    ("sgd", 2): (2,),
}
#: (embedding optimizer, saved ranks, saved type, ranks, type) of each resume
CASES = [
    (optimizer, saved_ranks, saved, ranks, current)
    for (optimizer, ranks), saved_rank_counts in RESUMED.items()
    for saved_ranks in saved_rank_counts
    for saved, current in itertools.product(SAVED[optimizer, saved_ranks], TYPES)
]


def checkpoint_dir(tmp, optimizer: str, ranks: int, sharding: str):
    return tmp / f"ckpt-{optimizer}-{ranks}-{sharding}"


def train_runs(tmp, ranks: int) -> list[dict]:
    return [
        {
            "args": [
                *MODEL,
                "--embedding_optimizer",
                optimizer,
                "--sharding_type",
                sharding,
                "--checkpoint_dir",
                str(checkpoint_dir(tmp, optimizer, ranks, sharding)),
                "--output_dir",
                str(tmp / f"out-{optimizer}-{ranks}-{sharding}"),
            ]
        }
        for (optimizer, saved_ranks), types in SAVED.items()
        if saved_ranks == ranks
        for sharding in types
    ]


def resume_runs(tmp, ranks: int) -> list[dict]:
    """One run per optimizer and type: it resumes each checkpoint of :func:`resumed_from` in turn."""
    return [
        {
            "args": [*MODEL, "--embedding_optimizer", optimizer, "--sharding_type", current],
            "resume": [str(checkpoint_dir(tmp, optimizer, r, s)) for r, s in resumed_from(optimizer, ranks)],
            "dump": str(tmp / f"dump-{optimizer}-{ranks}-{current}"),
        }
        for (optimizer, resumed_ranks) in RESUMED
        if resumed_ranks == ranks
        for current in TYPES
    ]


def resumed_from(optimizer: str, ranks: int) -> list[tuple[int, str]]:
    return [(r, s) for r in RESUMED[optimizer, ranks] for s in SAVED[optimizer, r]]


def launch(tmp, name: str, ranks: int, runs: list[dict]) -> None:
    (tmp / f"{name}.json").write_text(json.dumps(runs))
    assert_ok(torchrun([f"{REPO}/tests/checkpoint_worker.py", str(tmp / f"{name}.json")], nproc=ranks, timeout=300))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every case of CASES -> (the checkpoint's tensors, the pieces each rank held once resumed)."""
    tmp = tmp_path_factory.mktemp("reshard")
    launch(tmp, "train-on-2", 2, train_runs(tmp, 2))
    launch(tmp, "on-1", 1, train_runs(tmp, 1) + resume_runs(tmp, 1))
    launch(tmp, "resume-on-2", 2, resume_runs(tmp, 2))
    checkpoints = {
        (optimizer, ranks, sharding): saved_tensors(str(checkpoint_dir(tmp, optimizer, ranks, sharding) / STEP_DIR))
        for (optimizer, ranks), types in SAVED.items()
        for sharding in types
    }
    cases = {}
    for optimizer, saved_ranks, saved, ranks, current in CASES:
        i = resumed_from(optimizer, ranks).index((saved_ranks, saved))
        dumps = [torch.load(tmp / f"dump-{optimizer}-{ranks}-{current}.{i}.rank{r}.pt") for r in range(ranks)]
        cases[optimizer, saved_ranks, saved, ranks, current] = checkpoints[optimizer, saved_ranks, saved], dumps
    return cases


def rowwise_blocks(state: torch.Tensor, rows: int) -> torch.Tensor:
    """A row-wise state as (column blocks, rows): FBGEMM's (blocks * rows,) or torch's (rows, 1)."""
    return state.reshape(-1, rows)


def expected_rowwise(saved: torch.Tensor, blocks: int) -> torch.Tensor:
    """The row-wise state ``saved`` (column blocks, rows) over ``blocks`` column blocks: kept
    where they are the same blocks; averaged into one (exact: each saved block holds its shard's
    mean, and they are equally wide); the saved row mean for each block (the estimate)."""
    if saved.shape[0] == blocks:
        return saved
    if blocks == 1:
        return saved.double().mean(0, keepdim=True).float()
    return saved.expand(blocks, -1)  # from one block: 256 columns are 1 block or 2


def expected_state(key: StateKey, current: torch.Tensor, saved: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """What a table's optimizer state ``key`` must be after resuming from ``saved``."""
    states = {
        parse_key(name.removeprefix("optimizer."), DLRM_TABLES): tensor
        for name, tensor in saved.items()
        if name.startswith("optimizer.")
    }
    saved_states = {k.name: tensor for k, tensor in states.items() if k is not None and k.table == key.table}
    first = saved_states.get("momentum1", saved_states.get("sum"))  # FBGEMM's name, torch's
    if key.name == "step":
        return saved_states.get("step", torch.tensor(float(step)))
    rows = ROWS[key.table]
    if first.numel() == current.numel() == rows * 256:  # per-element: renamed only
        return first.reshape(current.shape)
    expected = expected_rowwise(rowwise_blocks(first, rows), rowwise_blocks(current, rows).shape[0])
    return expected.reshape(current.shape)


#: Per embedding optimizer: the states of a table under a fused sharding, under data_parallel.
TABLE_STATES = {
    "rowwise_adagrad": ({"momentum1"}, {"sum", "step"}),
    "adagrad": ({"momentum1"}, {"sum", "step"}),
    "sgd": (set(), set()),
}


@pytest.mark.parametrize("optimizer, saved_ranks, saved, ranks, current", CASES)
def test_resumes_with_tables_and_optimizer_state(resumed, optimizer, saved_ranks, saved, ranks, current):
    checkpoint, dumps = resumed[optimizer, saved_ranks, saved, ranks, current]
    assert {table["type"] for table in dumps[0]["plan"].values()} == {current}
    assert dumps[0]["progress"]["step"] == STEPS
    pieces = [dump["pieces"] for dump in dumps]
    names = sorted(set().union(*pieces))  # a table-wise table's optimizer state is on its rank only
    table_states = {table: set() for table in ROWS}
    for name in names:
        held = assemble(pieces, name)
        key = parse_key(name.removeprefix("optimizer."), DLRM_TABLES)
        if key is None:  # weights, the MLPs' optimizer state, progress: as saved, under any sharding
            if not name.startswith("rng_"):  # each rank's own stream: restored only on as many ranks
                assert torch.equal(held, checkpoint[name].float()), name
        else:
            table_states[key.table].add(key.name)
            assert torch.equal(held, expected_state(key, held, checkpoint, STEPS)), name
    assert sum(name.startswith("model.") and ".embedding_bags." in name for name in names) == len(ROWS)
    fused, data_parallel = TABLE_STATES[optimizer]
    assert table_states == {table: data_parallel if current == "data_parallel" else fused for table in ROWS}


@pytest.mark.unit
@pytest.mark.parametrize(
    "saved, current, expected",
    [
        (((0, 256),), ((0, 256),), ColumnMap((((0, 256),),), True)),
        (((0, 128), (128, 128)), ((0, 256),), ColumnMap((((0, 128), (1, 128)),), True)),
        (((0, 256),), ((0, 128), (128, 128)), ColumnMap((((0, 128),), ((0, 128),)), False)),
        (((0, 128), (128, 128)), ((0, 64), (64, 192)), ColumnMap((((0, 64),), ((0, 64), (1, 128))), False)),
    ],
)
def test_column_map_says_where_each_column_block_comes_from_and_whether_exactly(saved, current, expected):
    assert column_map(saved, current) == expected


BAGS = "model.sparse_arch.embedding_bag_collection.embedding_bags"
#: An EmbeddingCollection's tables (a sequence model's, such as the HSTU's), at a path of its own.
SEQUENCE_TABLES = Tables.of("model.item_embeddings", "EmbeddingCollection")


@pytest.mark.unit
@pytest.mark.parametrize(
    "key, expected",
    [
        (f"state.fused.{BAGS}.t_cat_3.weight.t_cat_3.momentum1", StateKey("t_cat_3", "momentum1", fused=True)),
        (f"state.dense.data_parallel_tables.{BAGS}.t_cat_0.weight.sum", StateKey("t_cat_0", "sum", fused=False)),
        ("state.dense.dense.model.dense_arch.model._mlp.0._linear.weight.sum", None),
    ],
)
def test_optimizer_state_keys_name_their_table(key, expected):
    assert parse_key(key, DLRM_TABLES) == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    "key, expected",
    [
        (
            "state.fused.model.item_embeddings.embeddings.items.weight.items.momentum1",
            StateKey("items", "momentum1", True),
        ),
        (
            "state.dense.data_parallel_tables.model.item_embeddings.embeddings.items.weight.step",
            StateKey("items", "step", False),
        ),
        (f"state.fused.{BAGS}.t_cat_3.weight.t_cat_3.momentum1", None),  # another module's table
    ],
)
def test_an_embedding_collections_state_keys_name_their_table(key, expected):
    assert parse_key(key, SEQUENCE_TABLES) == expected
    assert SEQUENCE_TABLES.weight_key("items") == "model.item_embeddings.embeddings.items.weight"
