"""``components.hstu:train``: the HSTU app on the machinery the DLRM shares, as a user runs it.

Training (few runs, each asserting several outcomes): two trainers on synthetic users learn the
planted transitions to within a stated margin of the exact ceiling and checkpoint; the same job
killed after its first checkpoint resumes to the very same results; its 2-rank checkpoint loads
on 1 rank (resharded) and measures what the 2 ranks measured; a small Parquet file of users trains.

Dry runs: on every cluster scheduler the HSTU's 2-node p4d job is the DLRM's reviewed job (the
golden files of test_dryrun.py and test_aws_batch.py), the app's module and job name aside: the
same resources, devices, mounts, environment and launcher.
"""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from apps.core.common.errors import ConfigError
from apps.hstu.config import HSTU_SYNTHETIC_STEPS, train_config
from tests.conftest import BIN, assert_ok, run
from tests.golden_files import assert_matches_golden
from tests.integration.test_aws_batch import QUEUE, _normalized
from tests.integration.test_aws_batch import torchx as torchx_aws
from tests.integration.test_dryrun import JOB_2X8, KUBEFLOW_CFG, KUBERNETES_CFG, dryrun, normalised

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

HSTU_TRAIN = "components.hstu:train"
#: The default run's length and batch (2 x 128 users a step: about a minute on two CPU trainers);
#: 4 evaluation batches of 128 users per rank (the 1,024 users' HR@10 is known to about +-0.013).
SMALL = ["--val_batches", "4", "--test_batches", "4", "--log_every", "50"]
STEPS = HSTU_SYNTHETIC_STEPS
#: Where the job checkpoints (and validates) on its way: late, so that the job resumed from there
#: is short (resuming exactly does not depend on where; DLRM's tests resume at every kind of step).
RESUMED_AT = STEPS - 50
#: How close to the ceiling (HR@10, NDCG@10 of the process that generates the users, exact) the
#: defaults get in STEPS steps.
MARGIN = 0.08


def torchx_run(tmp_path, j: str, *options: str):
    """``torchx run -s local_cwd components.hstu:train -j J OPTIONS``, as a user runs it."""
    return run([f"{BIN}/torchx", "run", "-s", "local_cwd", HSTU_TRAIN, "-j", j, *options], cwd=str(tmp_path))


def summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The synthetic job, checkpointing on its way and at the end, validating at the end (as
    synthetic data does by default): its checkpoint folder and run folder."""
    tmp = tmp_path_factory.mktemp("hstu")
    checkpoints, out = tmp / "ckpt", tmp / "out"
    options = [*SMALL, "--checkpoint_every", str(RESUMED_AT)]  # the default length: no --steps
    result = torchx_run(tmp, "1x2", *options, "--checkpoint_dir", str(checkpoints), "--output_dir", str(out))
    assert_ok(result)
    return tmp, checkpoints, out, options


def test_synthetic_training_reaches_the_ceiling_and_resumes_exactly(trained):
    tmp, checkpoints, out, options = trained
    first = summary(out)
    assert first["world_size"] == 2 and first["steps"] == STEPS and first["resumed_from_step"] is None
    for metric in ("hr@10", "ndcg@10"):
        ceiling = first[f"{metric}_ceiling"]
        assert 0.3 < ceiling < 1, first
        assert first[f"val_{metric}"] >= ceiling - MARGIN, (metric, first)
        assert first[f"test_{metric}"] >= ceiling - MARGIN, (metric, first)
    # both tables (items, actions) were placed, on the two ranks between them
    assert {line.split(":")[0] for line in first["sharding_plan"]} == {"item_table", "action_table"}
    assert {"0", "1"} <= set(",".join(line.rsplit(" ", 1)[-1] for line in first["sharding_plan"]).split(","))
    # Killed after its checkpoint on the way (its folder without the last one): the same command
    # resumes it to the same end.
    killed = tmp / "killed"
    shutil.copytree(checkpoints, killed, ignore=shutil.ignore_patterns(f"step_{STEPS:08d}", "BEST"))
    again = tmp / "again"
    result = torchx_run(tmp, "1x2", *options, "--checkpoint_dir", str(killed), "--output_dir", str(again))
    assert_ok(result)
    assert "resumed from" in result.stderr and f"(step {RESUMED_AT})" in result.stderr, result.stderr[-3000:]
    resumed = summary(again)
    assert resumed["resumed_from_step"] == RESUMED_AT
    for name in ("val_hr@10", "val_ndcg@10", "val_mrr", "test_hr@10", "test_ndcg@10", "final_train_loss"):
        assert resumed[name] == first[name], name


def test_a_two_rank_checkpoint_evaluates_alike_on_one_rank(trained):
    """Resharded: the 2-rank job's last checkpoint (each table on one rank) loads into one rank,
    whose 8 evaluation batches are the users of the 2 ranks' 4 each (rank r's batch i is block
    2i + r): the same validation and test metrics."""
    tmp, checkpoints, out, _ = trained
    two = summary(out)
    one = tmp / "one"
    options = ["--batch_size", "128", "--val_batches", "8", "--test_batches", "8", "--output_dir", str(one)]
    result = torchx_run(tmp, "1x1", *options, "--checkpoint_dir", str(checkpoints), "--evaluate_checkpoint", "latest")
    assert_ok(result)
    evaluated = summary(one)
    assert evaluated["world_size"] == 1 and evaluated["evaluated_step"] == STEPS
    for metric in ("val_hr@10", "val_ndcg@10", "val_mrr", "test_hr@10", "test_ndcg@10", "test_mrr"):
        assert evaluated[metric] == pytest.approx(two[metric], abs=1e-9), metric


def write_users(path, users: int = 600, seed: int = 0) -> None:
    """One row per user (Yambda's layout): lists of item ids, event types and timestamps; each
    user walks items i, i+1, i+2, ... so that the next item is learnable."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (users,), generator=generator).tolist()
    starts = torch.randint(0, 1000, (users,), generator=generator).tolist()
    items = [[(start + i) % 1000 for i in range(length)] for start, length in zip(starts, lengths)]
    table = pa.table(
        {
            "user_id": list(range(users)),
            "item_id": items,
            "event_type": [[i % 4 for i in row] for row in items],
            "timestamp": [list(range(1_700_000_000, 1_700_000_000 + 60 * len(row), 60)) for row in items],
        }
    )
    pq.write_table(table, path)


def test_a_parquet_file_of_users_trains_epochs_and_evaluates_each_user_once(tmp_path):
    write_users(tmp_path / "users.parquet", users=550)
    out, checkpoints = tmp_path / "out", str(tmp_path / "ckpt")
    options = ["--data", "parquet", "--data_path", str(tmp_path / "users.parquet"), "--num_items", "1000"]
    options += ["--val_batches", "0", "--test_batches", "0", "--checkpoint_dir", checkpoints]  # 0: all users
    result = torchx_run(
        tmp_path,
        "1x2",
        *options,
        "--batch_size",
        "100",
        "--epochs",
        "30",
        "--log_every",
        "10",
        "--output_dir",
        str(out),
    )
    assert_ok(result)
    done = summary(out)
    # 550 users, 2 x 100 a step: 2 steps an epoch, validated after each (the pipeline paused)
    assert done["steps"] == 60 and done["epochs"] == 30 and "hr@10_ceiling" not in done
    assert len([line for line in (out / "metrics.jsonl").read_text().splitlines() if '"val"' in line]) == 30
    # the next item is the last one plus 1: learnt far above chance (10 of 1,000 items)
    assert done["val_hr@10"] > 0.5, done
    # Each user once: the 3 rounds of 2 x 100 held 50 users of padding, which count not; so the
    # figures are those of one batch of all 550 users on one rank.
    one = tmp_path / "one"
    evaluation = ["--evaluate_checkpoint", "best", "--batch_size", "550", "--output_dir", str(one)]
    assert_ok(torchx_run(tmp_path, "1x1", *options, *evaluation))
    evaluated = summary(one)
    for metric in ("hr@10", "ndcg@10", "mrr"):  # the run tested its best validation's model
        assert evaluated[f"val_{metric}"] == pytest.approx(done[f"best_val_{metric}"], abs=1e-9), metric
        assert evaluated[f"test_{metric}"] == pytest.approx(done[f"test_{metric}"], abs=1e-9), metric


def as_dlrm(text: str) -> str:
    """``text`` with the HSTU app's names (its modules apps.hstu.*, its job name hstu) the DLRM's."""
    return text.replace("hstu", "dlrm")


def test_slurm_dryrun_is_the_dlrm_job(tmp_path):
    script = dryrun(tmp_path, "slurm", component=HSTU_TRAIN).split("# SBATCH_SCRIPT\n#----------------\n")[1]
    assert "-m apps.hstu.train" in script and "-m apps.hstu.torchrun" in script
    assert_matches_golden("slurm_train_2x8_p4d.sh", as_dlrm(normalised(script)))


def test_kubernetes_dryrun_is_the_dlrm_job(tmp_path):
    job = yaml.safe_load(
        dryrun(tmp_path, "kubernetes", "-cfg", KUBERNETES_CFG, "--workspace", "", component=HSTU_TRAIN)
    )
    text = normalised(json.dumps(job), app_id=job["metadata"]["name"])
    assert_matches_golden("kubernetes_train_2x8_p4d.yaml", as_dlrm(yaml.safe_dump(json.loads(text), width=1000)))


@pytest.mark.parametrize(
    "api, golden", [("pytorchjob", "kubeflow_train_2x8_p4d.yaml"), ("trainer", "kubeflow_trainer_train_2x8_p4d.yaml")]
)
def test_kubeflow_dryrun_is_the_dlrm_job(tmp_path, api, golden):
    text = dryrun(tmp_path, "kubeflow", "-cfg", f"api={api},{KUBEFLOW_CFG}", component=HSTU_TRAIN)
    name = yaml.safe_load(text)["metadata"]["name"]
    assert_matches_golden(golden, as_dlrm(normalised(text.rstrip() + "\n", name=name)))


def test_aws_batch_dryrun_is_the_dlrm_job(monkeypatch):
    monkeypatch.delenv("LOGLEVEL", raising=False)  # dist.torchrun copies it into the job's env
    cfg = f"queue={QUEUE},user=alice"
    result = torchx_aws(
        "run", "--dryrun", "--json", "-s", "aws_batch", "-cfg", cfg, "--workspace", "", HSTU_TRAIN, *JOB_2X8
    )
    assert result.returncode == 0, result.stderr
    request = _normalized(json.loads(result.stdout))
    assert_matches_golden("aws_batch_train_2x8_p4d.json", as_dlrm(json.dumps(request, indent=2) + "\n"))


@pytest.mark.unit
def test_the_config_is_the_shared_sections_with_the_hstus_defaults_and_metrics():
    cfg = train_config()
    assert (cfg.training.dense_optimizer, cfg.training.learning_rate) == ("adam", 0.2)
    assert cfg.evaluation.early_stopping_metric == "ndcg@10"
    assert train_config(objective="ranking").evaluation.early_stopping_metric == "auroc"
    with pytest.raises(ConfigError, match="--early_stopping_metric hr@10 is not measured with --objective ranking"):
        train_config(objective="ranking", early_stopping_metric="hr@10")
    with pytest.raises(ConfigError, match="synthetic data never repeats"):
        train_config(epochs=2)
    # a checkpoint of another item table is refused on resume (apps.core.checkpoint.checkpointer)
    assert cfg.model_signature() != train_config(num_items=3000).model_signature()
    assert cfg.model_signature() == train_config(learning_rate=0.1).model_signature()
