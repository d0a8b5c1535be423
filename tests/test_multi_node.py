"""Multi-node jobs across hosts that share no disk and reach each other only over the network
(tests/hosts.py): rendezvous where a hostname resolves to loopback, equal results to one host.
"""

import json
import os

import pytest
from torchx import specs

from apps.dlrm.config import parse_train_config
from components import dlrm
from tests.conftest import TINY, assert_ok, torchrun
from tests.hosts import DISK, two_hosts, wait_all  # noqa: F401  (fixture)

# Data depends on the global rank only: 2 hosts x 1 trainer and 1 host x 2 trainers see the
# same batches, so they must end with the same loss.
TRAIN = {name: getattr(parse_train_config(TINY), name) for name in (flag[2:] for flag in TINY[::2])}


@pytest.fixture(scope="module")
def one_host_loss(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_host")
    assert_ok(torchrun(["-m", "apps.dlrm.train", *TINY, "--output_dir", str(out)], nproc=2))
    return json.loads((out / "summary.json").read_text())["final_train_loss"]


def role_on(host: int, j: str, **train) -> specs.Role:
    """The component's role as the scheduler would run it on node ``host`` (macros applied)."""
    (role,) = dlrm.train(j=j, **{**TRAIN, **train}).roles
    values = specs.macros.Values(img_root="", app_id="xhost", replica_id=str(host - 1),
                                 rank0_env="TORCHX_RANK0_HOST")
    return values.apply(role)


def start_job(hosts, tmp_path, rank0_host: dict[int, str], j: str = "2x1", **train) -> list:
    """Starts the component's command on every host; ``rank0_host``: what each host is told
    the first node is (Kubernetes and AWS Batch tell the first node itself ``localhost``)."""
    processes = []
    for host, rank0 in rank0_host.items():
        role = role_on(host, j, **train)
        processes.append(hosts.start(host, ["bash", "-c", role.args[1]], str(tmp_path / f"host{host}.log"),
                                     **role.env, TORCHX_RANK0_HOST=rank0))
    return processes


def logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(tmp_path.glob("host*.log")))


@pytest.mark.parametrize(
    "rank0_host",
    [{1: "localhost", 2: "host1"}, {1: "host1", 2: "host1"}],
    ids=["first-node-is-localhost-to-itself", "first-node-name-is-loopback-on-itself"],
)
def test_torchrun_across_two_hosts_equals_one_host(two_hosts, tmp_path, one_host_loss, rank0_host):
    out = f"{DISK}/out"
    codes = wait_all(start_job(two_hosts, tmp_path, rank0_host, output_dir=out), timeout=240)
    assert codes == [0, 0], logs(tmp_path)
    summary = json.loads(open(os.path.join(two_hosts.disk(1), "out", "summary.json")).read())
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert abs(summary["final_train_loss"] - one_host_loss) <= 1e-6, (summary["final_train_loss"], one_host_loss)
    assert not os.path.exists(os.path.join(two_hosts.disk(2), "out", "summary.json"))  # rank 0's only
    assert f"this host is {two_hosts.addr(2)} on eth0" in (tmp_path / "host2.log").read_text()
