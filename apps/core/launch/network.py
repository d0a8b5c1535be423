"""Which address and network interface of this host the other hosts of a job reach it by.

torchrun and gloo guess this host's address from its hostname. On many cloud images (and in
network namespaces) the hostname resolves to a loopback address such as 127.0.1.1: torchrun
then publishes the rendezvous store as ``localhost`` and gloo advertises 127.0.0.1, and the
other hosts cannot connect. Here the choice follows the route to the rendezvous endpoint
instead: the interface this host's packets to the endpoint leave by, or, on the endpoint's own
host, the interface of the default route (the only non-loopback interface when there is no
default route).
"""

import fcntl
import ipaddress
import logging
import socket
import struct
import time
from dataclasses import dataclass

from apps.core.common.errors import ConfigError

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_ROUTES = "/proc/net/route"
#: Seconds a rendezvous host name that does not resolve yet is waited for (see :func:`resolve`).
RESOLVE_WAIT_S = 120.0
_RESOLVE_RETRY_S = 2.0


@dataclass(frozen=True)
class HostAddress:
    """This host as the other hosts of a job see it."""

    address: str  # IPv4 address to advertise (torchrun's --local_addr)
    interface: str  # its interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
    hosts_endpoint: bool  # the rendezvous endpoint is this host


def interface_addresses() -> dict[str, str]:
    """Every up, non-loopback interface that has an IPv4 address: name -> address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found[name] = address
    return found


def default_route_interface(routes_file: str = _ROUTES) -> str | None:
    """The interface of the IPv4 default route, if there is one."""
    try:
        with open(routes_file) as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    return next((row[0] for row in rows if len(row) > 1 and row[1] == "00000000"), None)


def resolve(host: str) -> str:
    """``host``'s IPv4 address here, or a ConfigError naming it.

    A name that does not resolve yet is asked again for up to RESOLVE_WAIT_S seconds: on Kubernetes
    the first pod's DNS record (a TrainJob's, an elastic PyTorchJob's Worker 0) can appear seconds
    after the other pods start, and nothing else makes them wait for it.
    """
    deadline = time.monotonic() + RESOLVE_WAIT_S
    waited = False
    while True:
        try:
            return socket.gethostbyname(host)
        except UnicodeError as e:  # not a host name at all: asking again cannot help
            error: Exception = e
            break
        except socket.gaierror as e:
            error = e
            if e.errno not in (socket.EAI_AGAIN, socket.EAI_NONAME) or time.monotonic() >= deadline:
                break
            if not waited:  # once: a mistyped name should not look like a hang
                logger.warning(
                    "the rendezvous host %r does not resolve yet (%s): asking again for up to %.0f s",
                    host,
                    e,
                    RESOLVE_WAIT_S,
                )
                waited = True
            time.sleep(_RESOLVE_RETRY_S)
    raise ConfigError(
        f"the rendezvous host {host!r} does not resolve on host {socket.gethostname()} ({error}): "
        "make the first node's name resolvable here (DNS or /etc/hosts), or give its address"
    ) from None


def source_address(destination: str) -> str:
    """The address packets from here to ``destination`` leave from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))  # UDP connect only picks the route
        return s.getsockname()[0]


def host_address(endpoint_host: str, interface: str | None = None) -> HostAddress | None:
    """How the other hosts reach this one, given the rendezvous endpoint's host.

    ``interface``: the user's choice (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), taken as given.
    None when this machine has no interface but loopback: then every node runs here.
    """
    interfaces = interface_addresses()
    endpoint = resolve(endpoint_host)
    hosts_endpoint = ipaddress.ip_address(endpoint).is_loopback or endpoint in interfaces.values()
    if interface is not None:
        if interface not in interfaces:
            raise ConfigError(
                f"network interface {interface} (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) has no "
                f"IPv4 address on host {socket.gethostname()}: use one of "
                f"{', '.join(sorted(interfaces)) or 'its interfaces'}"
            )
        return HostAddress(interfaces[interface], interface, hosts_endpoint)
    by_address = {a: name for name, a in interfaces.items()}
    if not hosts_endpoint:
        address = source_address(endpoint)
        return HostAddress(address, by_address[address], hosts_endpoint=False)
    if not ipaddress.ip_address(endpoint).is_loopback:
        return HostAddress(endpoint, by_address[endpoint], hosts_endpoint=True)
    return _own_host_address(endpoint_host, interfaces)


def _own_host_address(endpoint_host: str, interfaces: dict[str, str]) -> HostAddress | None:
    """The endpoint is this host, named by a loopback address: the others use another one."""
    default = default_route_interface()
    if default in interfaces:
        return HostAddress(interfaces[default], default, hosts_endpoint=True)
    if len(interfaces) == 1:
        ((name, address),) = interfaces.items()
        return HostAddress(address, name, hosts_endpoint=True)
    if not interfaces:
        return None
    listed = ", ".join(f"{name} ({address})" for name, address in sorted(interfaces.items()))
    raise ConfigError(
        f"the rendezvous host {endpoint_host!r} is this host ({socket.gethostname()}), which has "
        f"several interfaces ({listed}) and no default route, so the one the other hosts reach "
        "is unknown: name it with --env GLOO_SOCKET_IFNAME=<interface> "
        "(NCCL_SOCKET_IFNAME=<interface> on GPUs)"
    )
