"""Hostile and sloppy option values: refused early, in one line that names them, by the app and
the components alike; and runs print no library noise a user cannot act on."""

import logging
import os
import shlex
import subprocess
import sys
import warnings

import pytest
import torch
from torch.distributed._shard._utils import DEPRECATE_MSG
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchx.specs.builders import materialize_appdef

from apps.core.common.library_warnings import filter_known_warnings
from apps.core.training.sharding import make_planner, make_topology, model_to_shard
from apps.dlrm.config import parse_train_config, train_config
from apps.dlrm.training.app import DLRM
from components import dlrm
from components.signature import InvalidComponentArgument

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"


def app_args(*component_args: str) -> list[str]:
    """The app's command line that ``torchx run components.dlrm:train ARGS`` would start."""
    (role,) = materialize_appdef(dlrm.train, list(component_args)).roles
    command = shlex.split(role.args[-1])
    return command[command.index("apps.dlrm.train") + 1 :]


@pytest.mark.parametrize("text", ["yes", "1", "on"])
def test_a_boolean_means_the_same_to_torchx_and_to_the_app(text):
    """TorchX turned every text but "true" into false; the app read these as true."""
    assert parse_train_config(["--shuffle", "false", "--allow_tf32", text]).launch.allow_tf32 is True
    cfg = parse_train_config(app_args("--shuffle", "false", "--allow_tf32", text))
    assert (cfg.data.shuffle, cfg.launch.allow_tf32) == (False, True)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--shuffle", "maybe"], "--shuffle: expected true or false"),
        (["--learning_rate", "nan"], "--learning_rate: expected a finite number, got 'nan'"),
        (["--zipf_exponent", "inf"], "--zipf_exponent: expected a finite number, got 'inf'"),
        (["--dense_learning_rate", "1e39"], "--dense_learning_rate: expected a number within float32's range"),
        (["--num_embeddings", "99999999999999999999999"], "exceed 2**63 bytes"),
        (["--num_sparse_features", "20000"], "--num_sparse_features 20000 is more than 1024"),
        (["-j", "1x100000"], "-j '1x100000' starts 100000 processes per node, more than 1024"),
        (["-j", "1x4", "--gpu", "2"], "-j '1x4' starts 4 processes per node but --gpu is 2"),
        (["--rdzv_port", "99999999"], "--rdzv_port 99999999 is not a TCP port: use one of 1-65535"),
        (["--name", ""], "--name '' is not a job name"),
        (["--name", "run,EVIL=1"], "--name 'run,EVIL=1' is not a job name"),
        (["--name", "run\n#SBATCH --uid=0"], "is not a job name"),
        (["--name", "run\n"], "is not a job name"),
        (["--env", "NOEQUALS"], "--env: expected KEY=VALUE pairs separated by commas"),
        (["--env", "A B=1"], "--env 'A B' is not an environment variable name"),
        (["--mounts", "garbage"], "--mounts 'garbage' is not a list of mounts"),
        (["--mounts", "type=bind,src=/data"], "(no dst=)"),
        (["--checkpoint_dir", "/ckpt/${app_id}"], "--checkpoint_dir '/ckpt/${app_id}': TorchX replaces"),
        (["--output_dir", "out/$$x"], "--output_dir 'out/$$x': TorchX replaces"),
        (["--env", "RUN=$replica_id"], "TorchX replaces $$ and $app_id"),
    ],
)
def test_bad_component_arguments_fail_before_anything_is_built(args, fragment):
    with pytest.raises(InvalidComponentArgument) as error:
        materialize_appdef(dlrm.train, args)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_dollar_text_that_torchx_leaves_alone_reaches_the_app_unchanged():
    cfg = parse_train_config(app_args("--checkpoint_dir", "/ckpt/${RUN}/$HOME"))
    assert cfg.checkpoint.checkpoint_dir == "/ckpt/${RUN}/$HOME"


@pytest.mark.parametrize("args", [["--learning_rate", "inf"], ["--num_sparse_features", "5000"]])
def test_the_app_refuses_the_same_values(args, capsys):
    with pytest.raises(SystemExit) as exit:
        parse_train_config(args)
    assert exit.value.code == 2
    assert args[1] in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, fragment",
    [(["--shuffle", "maybe"], "--shuffle: expected true or false"), (["--mounts", "garbage"], "--mounts 'garbage'")],
)
def test_torchx_prints_one_line_not_a_traceback(args, fragment, tmp_path):
    result = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "torchx"),
            "run",
            "--dryrun",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert result.returncode == 1
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_the_planner_warns_about_nothing_and_reserves_what_torchrec_would(caplog):
    cfg = train_config(num_sparse_features=2, num_embeddings=100)
    model, sharders = model_to_shard(DLRM, cfg, dense_device=torch.device("meta"))
    topology = make_topology(4, 2, "cuda", hbm_cap_bytes=2**30)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        ours = make_planner(DLRM, cfg, model, topology)
        plan = ours.plan(model, sharders)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert "dense tensor size calculation" not in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = EmbeddingShardingPlanner(topology=topology, batch_size=cfg.training.batch_size)
        assert str(default.plan(model, sharders)) == str(plan)
    reserved = [r.last_reserved_topology.devices for r in (ours._storage_reservation, default._storage_reservation)]
    assert reserved[0] == reserved[1]


def test_dcp_sharded_tensor_deprecation_is_filtered_and_nothing_else():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn(DEPRECATE_MSG, FutureWarning, stacklevel=1)
        warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another deprecation"]
