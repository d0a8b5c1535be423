"""components.dlrm:train builds the AppDef TorchX submits; bad arguments fail before submission."""

import json
import os
import shlex
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchx import specs
from torchx.specs.builders import materialize_appdef

from apps.core.launch.job_shape import parse_job_size
from apps.core.options import options_of
from apps.dlrm.config import JobConfig, train_config
from components import dlrm, hstu
from components.launch import DEFAULT_ENV
from components.signature import InvalidComponentArgument
from tests.conftest import REPO
from tests.unit.test_zch_columns import CRITEO_PARQUET, criteo_parquet

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"


def app_command(app: specs.AppDef) -> list[str]:
    (role,) = app.roles
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    return shlex.split(role.args[1])


def test_default_job_is_two_trainers_on_one_node():
    app = dlrm.train()
    (role,) = app.roles
    cmd = app_command(app)
    assert cmd[:3] == ["python", "-m", "apps.dlrm.torchrun"]  # torchrun, picking host addresses
    assert cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[cmd.index("-m", 3) + 1] == "apps.dlrm.train"
    assert role.num_replicas == 1
    assert role.max_retries == 0
    for key, value in DEFAULT_ENV.items():
        assert role.env[key] == value


def test_training_arguments_reach_the_app_unchanged():
    app = dlrm.train(
        batch_size=4096,
        sharding_type="row_wise",
        num_sparse_features=3,
        num_embeddings_per_feature=[10, 20, 30],
        allow_tf32=False,
    )
    cmd = app_command(app)
    app_args = cmd[cmd.index("apps.dlrm.train") + 1 :]
    from apps.dlrm.config import parse_train_config

    assert parse_train_config(app_args) == train_config(
        batch_size=4096,
        sharding_type="row_wise",
        num_sparse_features=3,
        num_embeddings_per_feature=[10, 20, 30],
        allow_tf32=False,
    )


def test_multi_node_elastic_resources_env_mounts_and_retries():
    app = dlrm.train(
        j="2:4x8",
        gpu=8,
        cpu=64,
        memMB=500_000,
        env={"NCCL_DEBUG": "INFO", "FOO": "bar"},
        mounts=["type=bind", "src=/data", "dst=/data", "readonly"],
        max_retries=3,
    )
    (role,) = app.roles
    cmd = app_command(app)
    assert cmd[cmd.index("--nnodes") + 1] == "2:4"
    assert cmd[cmd.index("--nproc_per_node") + 1] == "8"
    assert specs.macros.rank0_env in role.args[1]  # multi-node rendezvous on the first node
    assert (role.min_replicas, role.num_replicas) == (2, 4)
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (64, 8, 500_000)
    assert role.env["NCCL_DEBUG"] == "INFO" and role.env["FOO"] == "bar"
    assert role.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert role.max_retries == 3
    (mount,) = role.mounts
    assert (mount.src_path, mount.dst_path, mount.read_only) == ("/data", "/data", True)


@pytest.mark.parametrize("j, size", [("1x2", (1, 1, 2)), ("2x8", (2, 2, 8)), ("1:4x8", (1, 4, 8)), ("4", (4, 4, None))])
def test_job_sizes(j, size):
    parsed = parse_job_size(j)
    assert (parsed.min_nodes, parsed.max_nodes, parsed.nproc_per_node) == size


@pytest.mark.parametrize("j", ["1y2", "x2", "2x", "0x2", "1x0", "4:2x8", "two", "1x2x3", ""])
def test_malformed_job_size_is_refused_with_the_accepted_forms(j):
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(j=j)
    assert repr(j) in str(error.value)
    assert "NNODESxNPROC" in str(error.value) or ">=" in str(error.value) or "MIN <= MAX" in str(error.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(num_embeddings_per_feature=[1, 2]), "--num_embeddings_per_feature has 2 entries"),
        (dict(sharding_type="grid"), "--sharding_type 'grid'"),
        (dict(over_arch_layer_sizes=[64, 2]), "must end in 1"),
        (dict(batch_size=0), "--batch_size 0"),
        (dict(memMB=0), "--memMB 0"),
        (dict(bogus=1), "unknown component arguments: bogus"),
        # Accepted at submission before, then a traceback in the job (issue 36):
        (dict(seed=-1), "--seed -1 must be in [0, 2^63 - 1]"),
        (dict(batch_size=10**12), f"--batch_size {10**12} is more than 16777216 samples per rank"),
        (dict(dense_arch_layer_sizes="64,,16"), "--dense_arch_layer_sizes: expected a comma-separated list of int"),
        (
            dict(num_embeddings=2**40),
            "--num_embeddings: the embedding tables' weights alone take 1,703,936 GiB (28,587,302,322,176 rows x 16 "
            "floats), more than the whole job's 8 GiB of memory",
        ),
    ],
)
def test_bad_arguments_fail_before_anything_is_built(kwargs, fragment):
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(**kwargs)
    assert fragment in str(error.value)


def test_hstu_tables_larger_than_the_whole_job_are_refused_at_submission():
    with pytest.raises(InvalidComponentArgument) as error:
        hstu.train(num_items=2**30)
    assert str(error.value).startswith("--num_items: the embedding tables' weights alone take 256 GiB")
    assert str(error.value).endswith("components.hstu:plan previews where they go")
    hstu.train(j="2", h="aws_p4d.24xlarge", num_items=2**30)  # 16 GPUs of 40 GiB and 2 hosts' memory


def test_tables_that_fit_the_jobs_gpus_but_not_its_host_memory_are_not_refused():
    """The submission check is a lower bound: host memory and every GPU's HBM count."""
    dlrm.train(
        j="1x1",
        gpu=1,
        memMB=16384,
        num_sparse_features=8,
        num_embeddings=10_000_000,
        embedding_dim=128,
        dense_arch_layer_sizes=[512, 256, 128],
    )  # 38 GiB of tables


def test_torchx_parses_the_same_text_forms():
    app = materialize_appdef(
        dlrm.train,
        [
            "-j",
            "2x4",
            "--batch_size",
            "64",
            "--dense_arch_layer_sizes",
            "32,16",
            "--allow_tf32",
            "False",
            "--env",
            "A=1,B=2",
        ],
    )
    cmd = app_command(app)
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[cmd.index("--batch_size") + 1] == "64"
    assert cmd[cmd.index("--dense_arch_layer_sizes") + 1] == "32,16"
    assert cmd[cmd.index("--allow_tf32") + 1] == "false"
    assert app.roles[0].env["A"] == "1"


def torchx(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "torchx"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_torchx_help_is_a_complete_manual(tmp_path):
    result = torchx("run", "components.dlrm:train", "--help", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in [field.name for field in options_of(JobConfig)] + ["max_retries", "mounts", "memMB"]:
        assert f"--{name}" in result.stdout, name
    text = " ".join(result.stdout.split())
    assert "TrainPipelineSparseDist" in text
    assert "the last must equal --embedding_dim" in text


def test_torchx_refuses_a_bad_component_argument_without_a_traceback(tmp_path):
    result = torchx("run", "--dryrun", "-s", "local_cwd", "components.dlrm:train", "-j", "1y2", cwd=str(tmp_path))
    assert result.returncode == 1
    assert "-j '1y2' is not a job size" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(pipeline="semi_sync"), "--pipeline semi_sync needs GPUs"),
        (dict(embedding_optimizer="adam"), "--embedding_optimizer adam needs GPUs"),
        (dict(compile_dense="reduce-overhead"), "--compile_dense reduce-overhead replays CUDA graphs"),
    ],
)
def test_gpu_only_options_on_a_job_without_gpus_are_refused_at_submission(kwargs, fragment):
    with pytest.raises(InvalidComponentArgument, match=fragment) as error:
        dlrm.train(**kwargs)
    assert str(error.value).endswith("(this job asks for no GPUs: for GPU nodes give -h or --gpu)")
    # Asking for GPU nodes, they are the job's to use.
    dlrm.train(j="2", h="aws_p4d.24xlarge", **kwargs)
    dlrm.train(j="1x2", gpu=2, **kwargs)


def test_an_apps_own_gpu_only_option_is_refused_at_submission():
    """HSTU's fused attention kernel is CUDA only: refused before the job starts, not in it."""
    with pytest.raises(InvalidComponentArgument, match="^--attention_kernel fused needs a CUDA GPU") as error:
        hstu.train(attention_kernel="fused")
    assert str(error.value).endswith("(this job asks for no GPUs: for GPU nodes give -h or --gpu)")
    hstu.train(j="1x2", gpu=2, attention_kernel="fused")


def test_local_parquet_data_that_cannot_serve_the_options_is_refused_at_submission(tmp_path):
    folder = tmp_path / "clicks"
    folder.mkdir()
    columns = {"label": [0, 1] * 8, "int_0": [0.5] * 16, "cat_0": list(range(16))}
    pq.write_table(pa.table(columns), folder / "part-0.parquet")
    data = dict(data="parquet", data_path=str(folder), dense_columns="int_0", sparse_columns="cat_0", eval_fraction=0.5)
    dlrm.train(**data)
    with pytest.raises(InvalidComponentArgument, match="part-0.parquet has no column 'click'"):
        dlrm.train(**data, label_column="click")
    with pytest.raises(
        InvalidComponentArgument, match="column 'cat_0' holds id 15 .*outside its embedding table of 10 rows"
    ):
        dlrm.train(**data, categorical_ids="as_is", num_embeddings=10)
    with pytest.raises(
        InvalidComponentArgument, match="hold out 16 rows, which leaves no training rows: hold out fewer"
    ):
        dlrm.train(**{**data, "eval_fraction": 1.0})
    # Data that is not on this machine is the job's to read.
    dlrm.train(**{**data, "data_path": str(tmp_path / "on_the_cluster")}, label_column="click")
    dlrm.train(**{**data, "data_path": "s3://bucket/clicks"}, label_column="click")


def test_torchx_refuses_a_missing_parquet_column_at_submission_in_one_line(tmp_path):
    folder = tmp_path / "clicks"
    folder.mkdir()
    pq.write_table(pa.table({"label": [0, 1], "int_0": [0.5, 1.0], "cat_0": [3, 4]}), folder / "part-0.parquet")
    args = ["--data", "parquet", "--data_path", str(folder), "--dense_columns", "int_0", "--sparse_columns", "cat_1"]
    result = torchx("run", "--dryrun", "components.dlrm:train", *args, cwd=str(tmp_path))
    assert result.returncode == 1
    assert "part-0.parquet has no column 'cat_1' (--sparse_columns)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_local_path_this_machine_lacks_is_refused_where_the_job_would_run_here(tmp_path):
    args = ["components.dlrm:train", "--data", "parquet", "--data_path", str(tmp_path / "nope")]
    here = torchx("run", "--dryrun", "-s", "local_cwd", *args, cwd=str(tmp_path))
    assert here.returncode == 1 and "Traceback" not in here.stderr
    assert (
        f"--data_path {tmp_path / 'nope'} does not exist on this machine, where -s local_cwd runs the job: fix "
        "the path (a folder, file or glob here), or give a URL"
    ) in here.stderr
    # A cluster's nodes may have it.
    assert torchx("run", "--dryrun", "-s", "slurm", *args, cwd=str(tmp_path)).returncode == 0


def test_component_resolves_from_any_directory(tmp_path):
    result = torchx(
        "run",
        "--dryrun",
        "--json",
        "-s",
        "local_cwd",
        "components.dlrm:train",
        "--steps",
        "7",
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    (role,) = json.loads(result.stdout)["app"]["roles"]
    assert "-m apps.dlrm.train --steps 7" in role["args"][1]


def test_submitting_imports_neither_torch_nor_the_data_readers():
    # Every `torchx run` imports the component: torch alone would add seconds to each submission,
    # numpy and TorchX's Docker client (through its Slurm scheduler) 0.18 s of its 0.4 s.
    heavy = "{'torch', 'pyarrow', 'torchrec', 'numpy', 'docker'}"
    code = f"import sys, components.dlrm, components.hstu; print(sorted({heavy} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_managed_column_a_pattern_matches_is_checked_where_the_files_are_here_and_left_to_the_trainers_elsewhere(
    tmp_path,
):
    """--sparse_columns 'C*' --zch_columns C3: the local files place C3 (table 2), whose 5 rows 3 ranks
    cannot split; a cluster's path is not read here, and the job is submitted for its trainers to check."""
    options = {**CRITEO_PARQUET, "sparse_columns": "C*", "zch_columns": "C3", "eval_fraction": 0.5, "j": "1x3"}
    options["num_embeddings_per_feature"] = [8, 8, 5] + [8] * 9
    with pytest.raises(InvalidComponentArgument, match=r"^--num_embeddings_per_feature 5 \(table 2\) on 3 ranks"):
        dlrm.train(**options, data_path=criteo_parquet(tmp_path / "clicks"))
    dlrm.train(**options, data_path=str(tmp_path / "on_the_cluster"))
