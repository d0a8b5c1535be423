"""The sharding-plan preview: TorchRec's planner as a dry run for a target cluster, on this CPU.

``components.dlrm:plan`` / ``python -m apps.dlrm.plan`` print the plan and each rank's memory
and say whether it fits; ``components.dlrm:train --check_plan true`` refuses to launch a job
whose plan does not fit. The model is reference document 002's MLPerf DLRM (97 GiB of tables).
"""

import json
import os
import re
import shlex
from types import SimpleNamespace

import pytest
from torchx import specs
from torchx.specs.builders import materialize_appdef

from apps.core.common.errors import ConfigError
from apps.core.launch.target import GiB, PlanTarget
from apps.core.training.plan import DOES_NOT_FIT
from apps.core.training.sharding import describe_plan
from apps.dlrm.config import parse_train_config, train_config
from apps.dlrm.data.criteo.tables import TABLE_SIZE_PRESETS
from apps.dlrm.plan import main as plan_app
from apps.dlrm.plan import preview
from apps.hstu.plan import main as hstu_plan_app
from components import dlrm, hstu
from components.signature import InvalidComponentArgument
from tests.conftest import BIN, LOCAL_TRAIN_1X2, assert_ok, run

# Tier (tests/conftest.py): real processes and servers; pure-logic tests are marked unit.
TIER = "integration"

MLPERF = dict(
    num_embeddings_per_feature=TABLE_SIZE_PRESETS["mlperf"],
    embedding_dim=128,
    dense_arch_layer_sizes=[512, 256, 128],
    over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
    batch_size=8192,
)
MLPERF_ARGS = [
    "--num_embeddings_per_feature",
    ",".join(map(str, MLPERF["num_embeddings_per_feature"])),
    "--embedding_dim",
    "128",
    "--dense_arch_layer_sizes",
    "512,256,128",
    "--over_arch_layer_sizes",
    "1024,1024,512,256,1",
    "--batch_size",
    "8192",
]
# 50M rows x 16 x 26 tables: 41 GiB per rank on 2 CPU ranks of the default 8 GB node.
TOO_BIG_FOR_CPU = ["--num_embeddings", "50000000"]
# One GPU planned with 8 GiB of HBM, 64 GiB of host memory, and 38 GiB of tables (8 x 10M x 128).
ONE_GPU_ARGS = ["-j", "1x1", "--gpu", "1", "--memMB", "65536", "--hbm_gb", "8"]
ONE_GPU = dict(
    num_sparse_features=8,
    num_embeddings=10_000_000,
    embedding_dim=128,
    dense_arch_layer_sizes=[512, 256, 128],
    hbm_gb=8,
)
ONE_GPU_CFG_ARGS = [
    "--num_sparse_features",
    "8",
    "--num_embeddings",
    "10000000",
    "--embedding_dim",
    "128",
    "--dense_arch_layer_sizes",
    "512,256,128",
]


def _ranks(option) -> list[int]:
    return sorted({shard.rank for shard in option.shards})


def test_mlperf_fits_one_p4d_node_with_each_big_table_on_its_own_gpu():
    result = preview(train_config(**MLPERF), PlanTarget(j="1x8", h="aws_p4d.24xlarge").cluster)
    cluster = result.cluster
    assert (cluster.world_size, cluster.device, cluster.hbm_per_rank) == (8, "cuda", 40 * GiB)
    assert cluster.ddr_per_rank == specs.resource(h="aws_p4d.24xlarge").memMB * 1024**2 // 8
    assert result.fits and result.verdict().startswith("fits: at most ")
    assert result.hbm_usable == int(40 * GiB * 0.85) and max(result.hbm_used) <= result.hbm_usable
    # the five 40M-row tables (19 GiB each with their optimizer state) take a GPU each
    big = [option for option in result.tables if option.tensor.shape[0] == 40_000_000]
    assert len(big) == 5 and len({rank for option in big for rank in _ranks(option)}) == 5
    # a rank holds its shards plus the same dense-part and input-feature estimate as every rank
    shards = [0] * 8
    for option in result.tables:
        for shard in option.shards:
            shards[shard.rank] += shard.storage.hbm
    (overhead,) = {used - held for used, held in zip(result.hbm_used, shards)}
    assert 0 < overhead < GiB
    # the placement shown is the plan TorchRec's planner returned
    assert describe_plan(result.plan).splitlines() == [
        f"{o.name}: {o.sharding_type} ({o.compute_kernel}) on ranks {','.join(map(str, _ranks(o)))}"
        for o in result.tables
    ]


def test_tables_too_big_for_hbm_are_cached_from_host_memory():
    result = preview(train_config(**MLPERF), PlanTarget(j="1x2", h="aws_p4d.24xlarge").cluster)
    assert result.fits
    assert any(option.compute_kernel == "fused_uvm_caching" for option in result.tables)
    assert max(result.ddr_used) > 10 * GiB
    assert "GiB host memory (rank" in result.verdict()


@pytest.mark.unit
def test_one_gpu_with_little_hbm_caches_the_tables_that_do_not_fit_from_host_memory(capsys):
    with pytest.raises(SystemExit) as exit:
        plan_app([*ONE_GPU_ARGS, *ONE_GPU_CFG_ARGS])
    assert exit.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "per rank: 8.00 GiB HBM (6.80 GiB usable), 64.00 GiB host memory"
    kernels = [line.split()[4] for line in out if line.startswith("t_cat_")]
    assert len(kernels) == 8 and "fused_uvm_caching" in kernels, out
    assert out[-1].startswith("fits: at most ") and "of 6.80 GiB usable HBM (rank 0)" in out[-1]


def test_a_plan_that_does_not_fit_says_how_much_it_needs_where():
    result = preview(train_config(**MLPERF), PlanTarget(j="1", h="aws_g5.xlarge").cluster)
    assert not result.fits
    verdict = result.verdict()
    needed = re.match(
        r"does not fit: needs (\d+\.\d\d) GiB HBM on rank 0, has 20\.40 GiB \(24\.00 GiB less the "
        r"15% TorchRec's planner keeps free\), and no placement fits with tables cached from its "
        r"15\.36 GiB of host memory either; use more ranks",
        verdict,
    )
    assert needed and float(needed[1]) > 90, verdict  # 97 GB of tables on one A10G


def test_row_wise_is_planned_for_gpus_on_this_cpu_machine():
    cfg = train_config(sharding_type="row_wise")
    result = preview(cfg, PlanTarget(j="2x8", h="aws_p4d.24xlarge").cluster)
    assert result.fits
    assert {(o.sharding_type, tuple(_ranks(o))) for o in result.tables} == {("row_wise", tuple(range(16)))}


@pytest.mark.unit
@pytest.mark.parametrize(
    "j, h",
    [("1x2", ""), ("4", ""), ("2", "aws_p4d.24xlarge"), ("2x4", "aws_p4d.24xlarge"), ("1:4x8", "aws_p5.48xlarge")],
)
def test_the_target_has_the_ranks_train_launches(j, h):
    cluster = PlanTarget(j=j, h=h).cluster
    cmd = shlex.split(dlrm.train(j=j, h=h or None).roles[0].args[1])
    nnodes = cmd[cmd.index("--nnodes") + 1]
    assert cluster.nodes == int(nnodes.split(":")[0])  # an elastic job is planned at its minimum
    assert cluster.nproc_per_node == int(cmd[cmd.index("--nproc_per_node") + 1])


@pytest.mark.unit
@pytest.mark.parametrize(
    "target, fragment",
    [
        (dict(h="aws_p9.24xlarge"), "-h 'aws_p9.24xlarge' is not a known instance type"),
        (dict(gpu=8), "how much memory a GPU of --gpu 8 has is not known: give it with --hbm_gb"),
        (dict(j="1x16", h="aws_p4d.24xlarge"), "asks for 16 processes per node but -h aws_p4d.24xlarge has 8 GPUs"),
        (dict(j="1x8", gpu=4, hbm_gb=80), "-j '1x8' starts 8 processes per node but --gpu is 4"),
        (dict(j="2", h="aws_m5.24xlarge"), "-h aws_m5.24xlarge has no GPUs to infer them from"),
        (dict(hbm_gb=80), "--hbm_gb 80 is for GPU nodes, but the job's nodes have no GPUs"),
        (
            dict(j="1", h="aws_p4d.24xlarge", hbm_gb=48),
            "--hbm_gb 48 is more than the 40 GiB of a GPU of -h aws_p4d.24xlarge",
        ),
        (dict(gpu=1, hbm_gb=-1), "--hbm_gb -1 must be 0 or more"),
        (dict(j="1y2"), "-j '1y2' is not a job size"),
        (dict(memMB=0), "--memMB 0 must be positive"),
    ],
)
def test_a_bad_target_is_refused_naming_the_value(target, fragment, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # this machine has no GPU to read
    with pytest.raises(ConfigError) as error:
        PlanTarget(**target)
    assert fragment in str(error.value)


def h200_here(monkeypatch) -> None:
    """This machine, as torch would see it with a GPU of the lent machines' name and size (an H200
    of 143,771 MiB, as nvidia-smi reported it)."""
    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=143_771 * 1024**2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: h200 if index == 0 else None)


@pytest.mark.unit
@pytest.mark.parametrize("plan_main", [plan_app, hstu_plan_app], ids=["dlrm", "hstu"])
def test_the_preview_of_gpu_ranks_reads_this_machine_s_gpu_memory_when_no_option_gives_it(
    plan_main, capsys, monkeypatch
):
    h200_here(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        plan_main(["-j", "1x1", "--gpu", "1", "--memMB", "65536"])
    assert exit.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == [
        "per rank: 140.40 GiB HBM (119.34 GiB usable), 64.00 GiB host memory",
        "GPU memory: 140.40 GiB, read from this machine's GPU 0 (NVIDIA H200)",
    ]
    assert out[-1].startswith("fits: ")
    # --hbm_gb, or -h's instance type, says it instead: nothing is read then
    monkeypatch.setattr("torch.cuda.get_device_properties", None)
    assert not PlanTarget(j="1x1", gpu=1, hbm_gb=8).cluster.hbm_source
    assert not PlanTarget(j="1", h="aws_p4d.24xlarge").cluster.hbm_source


@pytest.mark.unit
def test_the_plan_component_reads_this_machine_s_gpu_memory_where_it_has_one(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(InvalidComponentArgument, match="give it with --hbm_gb"):
        dlrm.plan(j="1x1", gpu=1)
    h200_here(monkeypatch)
    (role,) = dlrm.plan(j="1x1", gpu=1).roles
    assert role.args == ["-m", "apps.dlrm.plan", "-j", "1x1", "--gpu", "1"]  # the preview reads it too
    assert hstu.plan(j="1x1", gpu=1).roles[0].args[:2] == ["-m", "apps.hstu.plan"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "cfg, fragment",
    [
        (dict(sharding_type="row_wise"), "offers no row-wise kinds for CPU ranks"),
        (dict(embedding_optimizer="adam"), "--embedding_optimizer adam needs GPUs"),
        (dict(qcomm_forward_precision="fp8"), "--qcomm_forward_precision fp8 needs GPUs"),
    ],
)
def test_what_a_cpu_job_cannot_run_is_refused_as_the_job_would(cfg, fragment):
    with pytest.raises(ConfigError) as error:
        preview(train_config(**cfg), PlanTarget().cluster)
    assert fragment in str(error.value)


def test_plan_app_exits_3_with_a_plain_verdict_when_it_does_not_fit(capsys):
    with pytest.raises(SystemExit) as exit:
        plan_app(["-j", "1x2", *TOO_BIG_FOR_CPU])
    assert exit.value.code == DOES_NOT_FIT == 3  # not 1: a crash's
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("does not fit: needs 41.17 GiB host memory on rank 0, has 4.00 GiB; use more ranks (-j)")
    )


@pytest.mark.unit
def test_plan_app_refuses_a_bad_value_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        plan_app(["-h", "aws_p4d.24xlarge", "-j", "1x16"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        "python -m apps.dlrm.plan: error: -j '1x16' asks for 16 processes per node but -h "
        "aws_p4d.24xlarge has 8 GPUs: use at most one process per GPU (e.g. -j 1x8)\n"
    )


@pytest.mark.unit
def test_plan_app_takes_the_components_flags_and_only_what_the_plan_depends_on(capsys):
    # -h is the instance type, as for the component; help is --help.
    with pytest.raises(SystemExit) as exit:
        plan_app(["--help"])
    assert exit.value.code == 0
    usage = capsys.readouterr().out
    assert "[-j J] [-h H]" in usage and "--embedding_dim" in usage and "--sharding_type" in usage
    assert "--data_path" in usage and "--sparse_columns" in usage  # where --zch_columns' columns fall
    for training_only in ("--learning_rate", "--checkpoint_dir", "--dense_transform", "--val_batches", "--steps"):
        assert training_only not in usage
    with pytest.raises(SystemExit) as exit:
        plan_app(["-j", "1x2", "--learning_rate", "3"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        "python -m apps.dlrm.plan: error: --learning_rate 3: not an option of the plan, which takes -j, -h "
        "and the options that change where the tables go (training-only ones do not; drop them): see --help\n"
    )
    # The component offers the same arguments.
    with pytest.raises(InvalidComponentArgument, match="unknown component arguments: learning_rate"):
        dlrm.plan(learning_rate="3")


@pytest.mark.unit
def test_plan_component_passes_its_arguments_to_the_app():
    app = dlrm.plan(j="2x8", h="aws_p4d.24xlarge", batch_size=8192)
    (role,) = app.roles
    assert role.entrypoint == "python" and role.num_replicas == 1
    assert role.args == ["-m", "apps.dlrm.plan", "-j", "2x8", "-h", "aws_p4d.24xlarge", "--batch_size", "8192"]
    with pytest.raises(InvalidComponentArgument, match="is not a known instance type"):
        dlrm.plan(h="aws_p9.24xlarge")


@pytest.mark.unit
def test_plan_component_plans_with_the_jobs_hbm_gb():
    """--hbm_gb is JobConfig's: declared once, it reaches the preview app, which plans with it."""
    app = materialize_appdef(dlrm.plan, ["-j", "1x1", "--gpu", "1", "--hbm_gb", "8"])
    (role,) = app.roles
    assert role.args == ["-m", "apps.dlrm.plan", "-j", "1x1", "--gpu", "1", "--hbm_gb", "8.0"]
    with pytest.raises(InvalidComponentArgument, match="--hbm_gb 8 is for GPU nodes"):
        dlrm.plan(hbm_gb="8")


@pytest.mark.unit
def test_train_passes_hbm_gb_to_the_app_and_refuses_what_the_app_would():
    app = materialize_appdef(dlrm.train, ["-j", "1x8", "-h", "aws_p4d.24xlarge", "--hbm_gb", "40"])
    cmd = shlex.split(app.roles[0].args[1])
    app_args = cmd[cmd.index("apps.dlrm.train") + 1 :]
    assert app_args == ["--hbm_gb", "40.0"]
    assert parse_train_config(app_args) == train_config(hbm_gb=40)
    with pytest.raises(
        InvalidComponentArgument, match="--hbm_gb 40 is for GPU nodes, but the job's nodes have no GPUs"
    ):
        dlrm.train(hbm_gb=40)
    with pytest.raises(InvalidComponentArgument, match="--hbm_gb 48 is more than the 40 GiB of a GPU of -h aws_p4d"):
        dlrm.train(j="1", h="aws_p4d.24xlarge", hbm_gb=48)


def test_torchx_runs_the_plan_component_on_this_cpu(tmp_path):
    result = run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "-s",
            "local_cwd",
            "components.dlrm:plan",
            "-j",
            "2x8",
            "-h",
            "aws_p4d.24xlarge",
            *MLPERF_ARGS,
        ],
        cwd=str(tmp_path),
    )
    assert_ok(result)
    out = result.stdout + result.stderr
    assert "TorchRec sharding plan for 2 nodes x 8 GPUs (16 ranks) of aws_p4d.24xlarge" in out
    assert re.search(r"python/0 t_cat_0 +40,000,000 +128 ", out)
    assert "python/0 fits: at most " in out


def test_check_plan_refuses_to_launch_a_job_that_does_not_fit(tmp_path):
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(check_plan=True, num_embeddings=50_000_000)
    assert str(error.value).startswith("--check_plan: does not fit: needs 41.17 GiB host memory on rank 0")
    # the check plans with the job's own --hbm_gb, the HBM its app will plan with
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(check_plan=True, j="1x1", gpu=1, memMB=16384, **ONE_GPU)
    assert re.match(
        r"--check_plan: does not fit: needs \d+\.\d\d GiB HBM on rank 0, has 6\.80 GiB "
        r"\(8\.00 GiB less the 15%",
        str(error.value),
    ), str(error.value)
    # and through TorchX's CLI: a one-line error, nothing submitted
    result = run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "--dryrun",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            "--check_plan",
            "true",
            *TOO_BIG_FOR_CPU,
        ],
        cwd=str(tmp_path),
    )
    assert result.returncode == 1
    assert "--check_plan: does not fit: needs 41.17 GiB host memory on rank 0" in result.stderr
    assert "Traceback" not in result.stderr and "=== SCHEDULER REQUEST ===" not in result.stdout


def test_check_plan_refuses_an_hstu_job_whose_item_table_does_not_fit():
    """The second app's train component plans with its own model (an EmbeddingCollection)."""
    with pytest.raises(InvalidComponentArgument) as error:
        hstu.train(check_plan=True, num_items=500_000_000)
    assert re.match(
        r"--check_plan: does not fit: needs \d+\.\d\d GiB host memory on rank 0, has 4\.00 GiB", str(error.value)
    )
    assert hstu.train(check_plan=True).roles[0].entrypoint  # the default model fits: the job is built


def test_check_plan_launches_a_job_that_fits_with_the_plan_it_previewed(tmp_path):
    out = tmp_path / "outputs"
    args = [
        "--num_embeddings",
        "2000",
        "--batch_size",
        "256",
        "--steps",
        "2",
        "--log_every",
        "1",
        "--val_batches",
        "1",
        "--test_batches",
        "1",
    ]
    result = run(
        [
            *LOCAL_TRAIN_1X2,
            "--check_plan",
            "true",
            *args,
            "--output_dir",
            str(out),
        ],
        cwd=str(tmp_path),
    )
    assert_ok(result)
    assert "--check_plan: fits: at most " in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    previewed = preview(train_config(**summary["config"]), PlanTarget(j="1x2").cluster)
    assert summary["sharding_plan"] == describe_plan(previewed.plan).splitlines()
