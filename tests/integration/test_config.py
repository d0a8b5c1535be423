"""JobConfig: validation at the edge, and one text form shared by the app and the component."""

import subprocess
import sys

import pytest

from apps.core.common.errors import ConfigError
from apps.core.options import options_of, to_argv
from apps.dlrm import config as dlrm_config
from apps.dlrm.config import JobConfig, parse_train_config, train_config
from apps.hstu import config as hstu_config

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"


@pytest.mark.unit
def test_defaults_are_valid_and_consistent():
    cfg = JobConfig()
    assert cfg.model.table_sizes == [cfg.model.num_embeddings] * cfg.model.num_sparse_features
    assert cfg.model.dense_arch_layer_sizes[-1] == cfg.model.embedding_dim
    assert cfg.model.over_arch_layer_sizes[-1] == 1
    assert train_config(dense_learning_rate=0).training.dense_lr == cfg.training.learning_rate


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(num_embeddings_per_feature=[100, 200, 300]), ["--num_embeddings_per_feature", "3", "26"]),
        (dict(num_embeddings_per_feature=[10] * 25 + [0]), ["--num_embeddings_per_feature", "entry 25", "0"]),
        (dict(num_embeddings=0), ["--num_embeddings", "0"]),
        (dict(embedding_dim=-4, dense_arch_layer_sizes=[8, -4]), ["--embedding_dim", "-4"]),
        (dict(batch_size=0), ["--batch_size", "0"]),
        (dict(steps=-1), ["--steps", "-1"]),
        (dict(sharding_type="diagonal"), ["--sharding_type", "diagonal", "row_wise"]),
        (dict(interaction_type="attention"), ["--interaction_type", "attention", "dcn"]),
        (dict(qcomm_forward_precision="fp4"), ["--qcomm_forward_precision", "fp4", "bf16"]),
        (dict(over_arch_layer_sizes=[64, 32, 2]), ["--over_arch_layer_sizes", "64,32,2", "end in 1"]),
        (dict(over_arch_layer_sizes=[]), ["--over_arch_layer_sizes", "non-empty"]),
        (dict(dense_arch_layer_sizes=[64, 32]), ["--dense_arch_layer_sizes", "64,32", "--embedding_dim (16)"]),
        (dict(dense_arch_layer_sizes=[0, 16]), ["--dense_arch_layer_sizes", "positive"]),
        (
            dict(interaction_type="projection", interaction_branch1_layer_sizes=[128, 60]),
            ["--interaction_branch1_layer_sizes", "multiple of --embedding_dim", "60"],
        ),
        (dict(learning_rate=0.0), ["--learning_rate", "0.0"]),
        (dict(val_batches=-2), ["--val_batches", "-2"]),
        # Accepted before, then a traceback in the job (issue 36):
        (dict(seed=-1), ["--seed -1 must be in [0, 2^63 - 1]", "give a seed such as"]),
        (dict(seed=10**23), [f"--seed {10**23} must be in [0, 2^63 - 1]"]),
        (dict(batch_size=10**12), [f"--batch_size {10**12} is more than 16777216", "give a smaller --batch_size"]),
    ],
)
def test_bad_values_name_the_value_and_the_fix(overrides, names):
    with pytest.raises(ConfigError) as error:
        train_config(**overrides)
    for name in names:
        assert name in str(error.value)


@pytest.mark.unit
def test_per_feature_sizes_follow_the_feature_count():
    cfg = train_config(num_sparse_features=3, num_embeddings_per_feature=[10, 20, 30])
    assert cfg.model.table_sizes == [10, 20, 30]


@pytest.mark.unit
def test_argv_round_trips_every_kind_of_value():
    cfg = train_config(
        num_sparse_features=2,
        num_embeddings_per_feature=[5, 7],
        embedding_dim=8,
        dense_arch_layer_sizes=[32, 8],
        learning_rate=0.125,
        allow_tf32=False,
        sharding_type="row_wise",
        output_dir="",
    )
    argv = to_argv(cfg)
    assert "--steps" not in argv  # defaults are not repeated
    assert argv[argv.index("--allow_tf32") + 1] == "false"
    assert argv[argv.index("--num_embeddings_per_feature") + 1] == "5,7"
    assert parse_train_config(argv) == cfg


def test_app_cli_rejects_bad_values_before_starting(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "apps.dlrm.train", "--over_arch_layer_sizes", "64,3", "--output_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--over_arch_layer_sizes 64,3 must end in 1" in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, said",
    [
        (["--dense_arch_layer_sizes", "64,,16"], "got '64,,16', which has an empty entry: give every entry a value"),
        (["--over_arch_layer_sizes", "64,1,"], "got '64,1,', which has an empty entry"),
        (["--seed", str(10**23)], f"expected an integer within int64's range (+-9.2e18), got '{10**23}'"),
    ],
)
def test_app_cli_refuses_an_empty_list_entry_and_an_integer_beyond_int64(capsys, argv, said):
    """64,,16 was read as 64,16 (a layer silently dropped); 10**23 overflowed where torch took it."""
    with pytest.raises(SystemExit) as refused:
        parse_train_config(argv)
    assert refused.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.unit
def test_app_cli_rejects_malformed_lists(capsys):
    # The app's command line (apps.dlrm.train's main parses it first thing; the real process's
    # refusal is checked above).
    with pytest.raises(SystemExit) as refused:
        parse_train_config(["--num_embeddings_per_feature", "10,ten"])
    err = capsys.readouterr().err
    assert refused.value.code == 2
    assert "--num_embeddings_per_feature" in err and "10,ten" in err


@pytest.mark.unit
def test_app_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as helped:
        parse_train_config(["--help"])
    out = capsys.readouterr().out
    assert helped.value.code == 0
    for name in (field.name for field in options_of(JobConfig)):
        assert f"--{name}" in out


@pytest.mark.unit
def test_sections_flatten_to_unique_option_names_and_back():
    """The command line names an option without its section: no two sections may share a name,
    and building from the flat names puts every value back in its section."""
    names = [field.name for field in options_of(JobConfig)]
    assert len(names) == len(set(names)) == 69  # with --zch_columns
    cfg = train_config(batch_size=64, embedding_dim=8, dense_arch_layer_sizes=[8], keep_last=3, hbm_gb=0.0)
    assert (cfg.training.batch_size, cfg.model.embedding_dim, cfg.checkpoint.keep_last) == (64, 8, 3)
    assert cfg.replace(batch_size=32).training.batch_size == 32 and cfg.training.batch_size == 64
    with pytest.raises(ConfigError, match="unknown options: batch"):
        train_config(batch=64)
    with pytest.raises(AttributeError, match="checkpoint_dir"):  # its home is cfg.checkpoint
        cfg.checkpoint_dir = "/elsewhere"  # type: ignore[attr-defined]


@pytest.mark.unit
@pytest.mark.parametrize("data", ["synthetic", "criteo"])
def test_dense_transform_is_refused_where_the_data_has_its_own(data):
    options = dict(data=data, data_path="/data/criteo" if data == "criteo" else "", dense_transform="log1p")
    with pytest.raises(ConfigError, match="--dense_transform log1p is read only with --data parquet: --data criteo"):
        train_config(**options)


@pytest.mark.unit
@pytest.mark.parametrize("app", [dlrm_config, hstu_config], ids=["dlrm", "hstu"])
def test_every_app_checks_its_config_in_the_order_core_keeps(app):
    """A value wrong in two ways is refused for the same one in every app (apps.core.config.
    check_job): the data's length before the shared sections (--epochs 0 of synthetic data is
    refused for having no epochs, not for being 0), each app's own sections and its cross checks
    in their places, evaluating a checkpoint's needs last."""
    with pytest.raises(ConfigError, match="^--epochs 0: synthetic data never repeats"):
        app.train_config(epochs=0)
    with pytest.raises(ConfigError, match="^--keep_last 0 must be positive"):
        app.train_config(keep_last=0, evaluate_checkpoint="best")
    with pytest.raises(ConfigError, match="^--learning_rate -1.0 must be positive"):
        app.train_config(learning_rate=-1.0, evaluate_checkpoint="best")
