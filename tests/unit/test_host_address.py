"""How a multi-node trainer's torchrun is told this host's address (apps/dlrm/torchrun.py,
apps/core/launch/torchrun_args.py, apps/core/launch/network.py): the pure parts. The real thing
runs across hosts in test_multi_node.py."""

import socket

import pytest

from apps.core.common.errors import ConfigError
from apps.core.launch import network, torchrun_args
from apps.core.launch.network import HostAddress

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

# What TorchX's dist.torchrun writes for -j 2x8, the first node's name filled in.
ARGS = [
    "--rdzv_backend",
    "c10d",
    "--rdzv_endpoint",
    "node1:29500",
    "--rdzv_id",
    "app",
    "--nnodes",
    "2",
    "--nproc_per_node",
    "8",
    "--tee",
    "3",
    "--role",
    "",
    "-m",
    "apps.dlrm.train",
    "--local_addr",
    "x",
]


def fake_host(monkeypatch, this: HostAddress, hostname_matches: bool = False):
    monkeypatch.setattr(torchrun_args, "host_address", lambda host, interface=None: this)
    monkeypatch.setattr(torchrun_args, "_matches_machine_hostname", lambda host: hostname_matches)


def test_a_worker_host_advertises_the_address_its_packets_to_the_endpoint_leave_from(monkeypatch):
    fake_host(monkeypatch, HostAddress("10.0.0.2", "eth1", hosts_endpoint=False))
    args, variables = torchrun_args.multi_node_args(list(ARGS), {})
    assert args[:2] == ["--local_addr", "10.0.0.2"] and args[2:] == ARGS  # the trainer's own --local_addr untouched
    assert variables == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}


def test_the_endpoint_host_hosts_the_store_when_torchrun_would_not_know_it(monkeypatch):
    fake_host(monkeypatch, HostAddress("10.0.0.1", "eth0", hosts_endpoint=True))
    args, _ = torchrun_args.multi_node_args(["--rdzv_conf", "timeout=900", *ARGS], {"NCCL_SOCKET_IFNAME": "ib0"})
    assert args[args.index("--rdzv_conf") + 1] == "timeout=900,is_host=1"
    assert args.count("--rdzv_conf") == 1
    fake_host(monkeypatch, HostAddress("10.0.0.1", "eth0", hosts_endpoint=True), hostname_matches=True)
    args, variables = torchrun_args.multi_node_args(list(ARGS), {"NCCL_SOCKET_IFNAME": "ib0"})
    assert "--rdzv_conf" not in args[: args.index("-m")]  # torchrun finds out by itself
    assert variables == {"GLOO_SOCKET_IFNAME": "eth0"}  # the user's NCCL choice is kept


def test_single_node_and_user_choices_are_left_alone(monkeypatch):
    fake_host(monkeypatch, HostAddress("10.0.0.2", "eth0", hosts_endpoint=False))
    single = ["--rdzv_endpoint", "localhost:0", "--nnodes", "1", "--nproc_per_node", "2", "-m", "m"]
    assert torchrun_args.multi_node_args(single, {}) == (single, {})
    given = ["--local_addr=10.9.9.9", *ARGS]
    assert torchrun_args.multi_node_args(given, {})[0] == given
    elastic = ["--nnodes", "1:2", "--rdzv_endpoint", "h:1", "-m", "m"]
    assert torchrun_args.multi_node_args(elastic, {})[0][:2] == ["--local_addr", "10.0.0.2"]


def test_an_unknown_interface_or_endpoint_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(network, "RESOLVE_WAIT_S", 0.0)
    monkeypatch.setattr(network, "interface_addresses", lambda: {"eth0": "10.0.0.2"})
    with pytest.raises(ConfigError, match="network interface eth7 .* use one of eth0"):
        network.host_address("127.0.0.1", interface="eth7")
    with pytest.raises(ConfigError, match="'no-such-host.invalid' does not resolve"):
        network.host_address("no-such-host.invalid")


def test_a_rendezvous_name_that_resolves_late_is_waited_for(monkeypatch, caplog):
    answers = iter([socket.gaierror(socket.EAI_NONAME, "Name or service not known")] * 2 + ["10.0.0.9"])

    def lookup(host):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(network, "_RESOLVE_RETRY_S", 0.0)
    monkeypatch.setattr(network.socket, "gethostbyname", lookup)
    assert network.resolve("dlrm-abc-node-0-0.dlrm-abc") == "10.0.0.9"
    said = [r.getMessage() for r in caplog.records if "does not resolve yet" in r.getMessage()]
    assert len(said) == 1 and "'dlrm-abc-node-0-0.dlrm-abc'" in said[0]  # once, naming the host


def test_the_endpoint_named_by_loopback_uses_the_default_route_or_the_only_interface(monkeypatch, tmp_path):
    routes = tmp_path / "route"
    routes.write_text("Iface\tDestination\tGateway\nens5\t0000A8C0\t00000000\nens6\t00000000\t0100A8C0\n")
    assert network.default_route_interface(str(routes)) == "ens6"
    monkeypatch.setattr(network, "interface_addresses", lambda: {"ens5": "192.168.0.5", "ens6": "10.1.0.6"})
    monkeypatch.setattr(network, "default_route_interface", lambda: "ens6")
    assert network.host_address("localhost") == HostAddress("10.1.0.6", "ens6", hosts_endpoint=True)
    monkeypatch.setattr(network, "default_route_interface", lambda: None)
    with pytest.raises(ConfigError, match=r"several interfaces .* --env GLOO_SOCKET_IFNAME=<interface>"):
        network.host_address("localhost")
    monkeypatch.setattr(network, "interface_addresses", lambda: {"eth0": "10.2.0.3"})
    assert network.host_address("127.0.0.1") == HostAddress("10.2.0.3", "eth0", hosts_endpoint=True)
    assert network.host_address("10.2.0.3") == HostAddress("10.2.0.3", "eth0", hosts_endpoint=True)
