"""``components.hstu:train``: the HSTU app on the machinery the DLRM shares, as a user runs it.

Dry runs: on every cluster scheduler the HSTU's 2-node p4d job is the DLRM's reviewed job (the
golden files of test_dryrun.py and test_aws_batch.py), the app's module and job name aside: the
same resources, devices, mounts, environment and launcher.
"""

import json

import pytest
import yaml

from tests.golden_files import assert_matches_golden
from tests.test_aws_batch import QUEUE, _normalized
from tests.test_aws_batch import torchx as torchx_aws
from tests.test_dryrun import JOB_2X8, KUBEFLOW_CFG, KUBERNETES_CFG, dryrun, normalised

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

HSTU_TRAIN = "components.hstu:train"


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
