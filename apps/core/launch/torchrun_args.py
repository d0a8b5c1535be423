"""torchrun's arguments for a multi-node job, completed with this host's address and network
interface, and the trainers' thread count: the machinery of ``python -m apps.<app>.torchrun`` (apps/core/torchrun.py).

For a job of more than one node it finds how the other hosts reach this one
(:mod:`apps.core.launch.network`) and adds what torchrun and the trainers would otherwise guess from
the hostname, wrongly wherever it resolves to loopback:

- ``--local_addr ADDRESS``: the address torchrun publishes for the trainers' store;
- ``--rdzv_conf is_host=1`` on the rendezvous endpoint's host, when torchrun would not recognise
  the endpoint as itself (its hostname does not resolve to the endpoint's address), and so would
  wait for a store that nobody starts;
- ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``: the interface gloo and NCCL connect over.

What the user set (``--local_addr``, ``is_host``, the two variables) is kept.

On any job it also sets the trainers' ``OMP_NUM_THREADS`` where a node runs several
(:func:`trainer_threads`), unless the user did.
"""

import logging
import os
import socket

from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

from apps.core.launch.agent import LAUNCHER_LOGGER
from apps.core.launch.network import host_address

logger = logging.getLogger(LAUNCHER_LOGGER)

_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: cgroup v2's CPU quota of this process's container: "QUOTA PERIOD" in microseconds, or "max ...".
_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def _torchrun_part(args: list[str]) -> int:
    """How many of ``args`` are torchrun's own: those before the trainer's module or script."""
    i = 0
    while i < len(args):
        if args[i] in ("-m", "--module") or not args[i].startswith("-"):
            return i
        i += 1 if "=" in args[i] or args[i] in _SWITCHES else 2
    return i


# torchrun's flags that take no value (among those TorchX's dist.torchrun writes).
_SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}


def _value(args: list[str], flag: str) -> str | None:
    """The value of torchrun's ``--flag VALUE`` or ``--flag=VALUE``."""
    own = args[: _torchrun_part(args)]
    for i, arg in enumerate(own):
        if arg == flag and i + 1 < len(own):
            return own[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _with(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with torchrun's ``--flag`` set to ``value`` (replaced where given, else added)."""
    own = _torchrun_part(args)
    for i, arg in enumerate(args[:own]):
        if arg == flag:
            return [*args[: i + 1], value, *args[i + 2 :]]
        if arg.startswith(flag + "="):
            return [*args[:i], f"{flag}={value}", *args[i + 1 :]]
    return [flag, value, *args]


def _max_nodes(args: list[str]) -> int:
    nnodes = _value(args, "--nnodes") or "1"
    return int(nnodes.split(":")[-1])


def multi_node_args(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """torchrun's arguments and the variables to set, completed for this host (see the module doc)."""
    endpoint = _value(args, "--rdzv_endpoint")
    if _max_nodes(args) < 2 or not endpoint or _value(args, "--rdzv_backend") not in (None, "c10d"):
        return args, {}
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    chosen = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0] or None
    this = host_address(host, interface=chosen)
    if this is None:
        logger.warning("this machine has no network interface but loopback: all nodes must run here")
        return args, {}
    if _value(args, "--local_addr") is None:
        args = _with(args, "--local_addr", this.address)
    rdzv_conf = _value(args, "--rdzv_conf")
    if this.hosts_endpoint and not _matches_machine_hostname(host) and "is_host" not in (rdzv_conf or ""):
        args = _with(args, "--rdzv_conf", f"{rdzv_conf},is_host=1" if rdzv_conf else "is_host=1")
    variables = {name: this.interface for name in _IFNAME_VARIABLES if not env.get(name)}
    logger.info(
        "host %s: rendezvous at %s%s; this host is %s on %s",
        socket.gethostname(),
        endpoint,
        " (hosted here)" if this.hosts_endpoint else "",
        this.address,
        this.interface,
    )
    return args, variables


def trainer_threads(nproc_per_node: str, env: dict[str, str], cpu_max: str = _CPU_MAX) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for several trainers on this host: its cores shared among them (at least
    1 each). Nothing where the user set it, or for one trainer, whose threads PyTorch's default
    (the physical cores) already fits, or where the count is not a number.

    Where a node runs several trainers torchrun otherwise sets 1, whatever the cores, and says
    so in a five-line warning in every job's log.
    """
    if "OMP_NUM_THREADS" in env or not nproc_per_node.isdigit() or int(nproc_per_node) < 2:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, available_cores(cpu_max) // int(nproc_per_node)))}


def available_cores(cpu_max: str = _CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity, capped by its container's CPU quota
    (a Kubernetes CPU limit, which the affinity does not show), rounded down."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):  # cgroup v1, or no container
        return cores
    return cores if quota == "max" else max(1, min(cores, int(quota) // int(period)))
