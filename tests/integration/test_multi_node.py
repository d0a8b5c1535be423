"""Multi-node jobs across hosts that share no disk and reach each other only over the network
(tests/hosts.py): rendezvous where a hostname resolves to loopback, equal results to one host.
"""

import json
import os
import time

import boto3
import pytest
from torchx import specs

from apps.core.options import option_values
from apps.dlrm.config import parse_train_config
from components import dlrm
from testing.moto_server import REGION, aws_env, moto_server
from tests.conftest import TINY, assert_ok, torchrun
from tests.hosts import DISK, wait_all
from tests.unit.test_criteo_data import write_folder

# Tier (tests/conftest.py): real processes and servers.
TIER = "integration"

# Data depends on the global rank only: 2 hosts x 1 trainer and 1 host x 2 trainers see the
# same batches, so they must end with the same loss.
TRAIN = {name: option_values(parse_train_config(TINY))[name] for name in (flag[2:] for flag in TINY[::2])}


def one_host_loss(out, *args: str) -> float:
    """The final loss of the same job as 2 trainers on this one machine."""
    assert_ok(torchrun(["-m", "apps.dlrm.train", *TINY, "--output_dir", str(out), *args], nproc=2))
    return json.loads((out / "summary.json").read_text())["final_train_loss"]


@pytest.fixture(scope="module")
def tiny_loss(tmp_path_factory):
    return one_host_loss(tmp_path_factory.mktemp("one_host"))


@pytest.fixture(scope="module")
def s3(two_hosts):
    """An S3 server on this machine's address on the hosts' bridge (every host reaches it), with
    a bucket; yields the AWS variables that point at it."""
    with moto_server(two_hosts.addr(0)) as endpoint:
        env = aws_env(endpoint)
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="dlrm", CreateBucketConfiguration={"LocationConstraint": REGION})
        env["client"] = client
        yield env


def role_on(host: int, j: str, **train) -> specs.Role:
    """The component's role as the scheduler would run it on node ``host`` (macros applied)."""
    (role,) = dlrm.train(j=j, **{**TRAIN, **train}).roles
    values = specs.macros.Values(img_root="", app_id="xhost", replica_id=str(host - 1), rank0_env="TORCHX_RANK0_HOST")
    return values.apply(role)


# What Kubernetes and AWS Batch tell each node the first node is: the first node itself hears
# ``localhost``, the others its name (or address).
FIRST_IS_LOCALHOST = {1: "localhost", 2: "host1"}


def start_on(hosts, tmp_path, host: int, rank0: str, j: str = "2x1", env: dict | None = None, **train):
    """Starts the component's command on ``host``, as a scheduler would start that node."""
    role = role_on(host, j, **train)
    log = str(tmp_path / f"host{host}.log")
    if os.path.exists(log):  # a node started again: keep what the first one wrote
        os.rename(log, f"{log}.{time.monotonic_ns()}")
    return hosts.start(host, ["bash", "-c", role.args[1]], log, **role.env, **(env or {}), TORCHX_RANK0_HOST=rank0)


def start_job(hosts, tmp_path, rank0_host: dict[int, str] = FIRST_IS_LOCALHOST, **kwargs) -> list:
    """Starts the component's command on every host; ``rank0_host``: what each is told the first node is."""
    return [start_on(hosts, tmp_path, host, rank0, **kwargs) for host, rank0 in rank0_host.items()]


def summary_on(hosts, host: int, folder: str) -> dict:
    return json.loads(open(os.path.join(hosts.disk(host), folder, "summary.json")).read())


def logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(tmp_path.glob("host*.log*")))


@pytest.mark.parametrize(
    "rank0_host",
    [FIRST_IS_LOCALHOST, {1: "host1", 2: "host1"}],
    ids=["first-node-is-localhost-to-itself", "first-node-name-is-loopback-on-itself"],
)
def test_torchrun_across_two_hosts_equals_one_host(two_hosts, tmp_path, tiny_loss, rank0_host):
    out = f"out-{tmp_path.name}"  # a folder per job: the app refuses another run's
    codes = wait_all(start_job(two_hosts, tmp_path, rank0_host, output_dir=f"{DISK}/{out}"), timeout=240)
    assert codes == [0, 0], logs(tmp_path)
    summary = summary_on(two_hosts, 1, out)
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert abs(summary["final_train_loss"] - tiny_loss) <= 1e-6, (summary["final_train_loss"], tiny_loss)
    assert not os.path.exists(os.path.join(two_hosts.disk(2), out, "summary.json"))  # rank 0's only
    assert f"this host is {two_hosts.addr(2)} on eth0" in (tmp_path / "host2.log").read_text()


def test_a_checkpoint_folder_of_each_hosts_own_is_refused_before_training(two_hosts, tmp_path):
    """The same local path is another disk on each host: refused, not silently never resumable."""
    for host in (1, 2):
        os.makedirs(os.path.join(two_hosts.disk(host), "ckpt"), exist_ok=True)
    codes = wait_all(
        start_job(two_hosts, tmp_path, checkpoint_dir=f"{DISK}/ckpt", output_dir=f"{DISK}/refused"), timeout=240
    )
    assert codes[0] != 0 and codes[1] != 0
    log = (tmp_path / "host1.log").read_text()
    assert f"--checkpoint_dir {DISK}/ckpt is not shared by every host of the job: host2 cannot read" in log, logs(
        tmp_path
    )
    assert "Use a folder that every host mounts" in log and "training steps" not in log
    for host in (1, 2):  # nothing written: no checkpoint, no probe left behind
        assert os.listdir(os.path.join(two_hosts.disk(host), "ckpt")) == []


def wait_for_commit(client, prefix: str, processes: list, timeout: float = 120) -> str:
    """The key of the first COMMITTED marker under ``prefix`` in the bucket, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="dlrm", Prefix=prefix).get("Contents", [])]
        committed = [key for key in keys if key.endswith("/COMMITTED")]
        if committed:
            return min(committed)
        assert all(p.poll() is None for p in processes), "the job ended before its first checkpoint"
        time.sleep(0.2)
    pytest.fail(f"no checkpoint committed under s3://dlrm/{prefix} in {timeout} s")


def test_a_killed_host_restarted_by_the_scheduler_resumes_from_s3(two_hosts, tmp_path, s3):
    """Every process of host 2 killed after the first commit; the scheduler starts the node again
    (as Kubernetes and AWS Batch do); torchrun on host 1 restarts its trainer (--max_retries 1)
    and both resume from the newest checkpoint in S3, to the uninterrupted run's loss."""
    env = {k: v for k, v in s3.items() if k != "client"}
    job = dict(
        steps=400,
        log_every=50,
        checkpoint_dir="s3://dlrm/killed",
        checkpoint_every=50,
        max_retries=1,
        output_dir=f"{DISK}/killed",
        env=env,
    )
    first, second = start_job(two_hosts, tmp_path, **job)
    committed = wait_for_commit(s3["client"], "killed/", [first, second])
    two_hosts.kill(2)
    second.wait()
    restarted = start_on(two_hosts, tmp_path, 2, FIRST_IS_LOCALHOST[2], **job)
    assert wait_all([first, restarted], timeout=300) == [0, 0], logs(tmp_path)
    summary = summary_on(two_hosts, 1, "killed")
    assert summary["steps"] == 400 and summary["resumed_from_step"] >= int(committed.split("/")[1][5:])
    expected = one_host_loss(tmp_path / "uninterrupted", "--steps", "400", "--log_every", "50")
    assert abs(summary["final_train_loss"] - expected) <= 1e-6, (summary["final_train_loss"], expected)


def test_criteo_from_s3_is_copied_once_to_each_hosts_own_disk(two_hosts, tmp_path, s3):
    folder = write_folder(tmp_path / "criteo", [3000, 3000, 3000, 2000], sizes=2000)
    for name in os.listdir(folder):
        s3["client"].upload_file(os.path.join(folder, name), "dlrm", f"criteo/{name}")
    env = {k: v for k, v in s3.items() if k != "client"}
    cache = f"{DISK}/criteo-cache"
    codes = wait_all(
        start_job(
            two_hosts,
            tmp_path,
            data="criteo",
            data_path="s3://dlrm/criteo",
            data_cache_dir=cache,
            output_dir=f"{DISK}/criteo",
            env=env,
        ),
        timeout=240,
    )
    assert codes == [0, 0], logs(tmp_path)
    for host in (1, 2):  # each host trained from a complete copy on its own disk
        copy = os.path.join(two_hosts.disk(host), "criteo-cache")
        assert sorted(os.listdir(copy)) == sorted(os.listdir(folder))
        for name in os.listdir(folder):
            with open(os.path.join(copy, name), "rb") as a, open(os.path.join(folder, name), "rb") as b:
                assert a.read() == b.read(), (host, name)
    expected = one_host_loss(tmp_path / "local", "--data", "criteo", "--data_path", folder)
    assert abs(summary_on(two_hosts, 1, "criteo")["final_train_loss"] - expected) <= 1e-6


def test_an_elastic_job_grows_when_a_second_host_joins(two_hosts, tmp_path):
    """-j 1:2x1: host 1 trains alone; when host 2 arrives, torchrun stops host 1's trainer, both
    rendezvous again, and training resumes on 2 ranks from the newest checkpoint, resharded."""
    # Host 2 must arrive while training remains: under load, a tiny model's 250 steps can end
    # before a second host has imported torch and joined, and a finished job only says that it
    # has nothing left to do. 1,000 steps leave it time.
    job = dict(
        j="1:2x1",
        steps=1000,
        log_every=50,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=50,
        output_dir=f"{DISK}/elastic",
    )
    first = start_on(two_hosts, tmp_path, 1, "localhost", **job)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "ckpt").glob("step_*/COMMITTED")):
        assert first.poll() is None and time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.2)
    second = start_on(two_hosts, tmp_path, 2, "host1", **job)
    assert wait_all([first, second], timeout=300) == [0, 0], logs(tmp_path)
    summary = summary_on(two_hosts, 1, "elastic")
    assert summary["world_size"] == 2 and summary["steps"] == 1000 and summary["resumed_from_step"] >= 50
