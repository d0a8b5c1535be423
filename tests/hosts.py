"""Several hosts on this machine for multi-node tests: scripts/netns_hosts.sh, driven from pytest.

Each host is a network namespace with its own address on a private bridge, its own hostname
(``host1``, ``host2``, ...; its own name resolves to 127.0.1.1 there, as on many cloud images) and
its own disk at ``DISK`` (another folder on every host). Processes started on a host run in a
session of their own; ``down`` (the fixture's teardown, also after a failed test) kills every
process of every host and deletes the namespaces and the bridge.
"""

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from tests.conftest import REPO, process_env

SCRIPT = os.path.join(REPO, "scripts", "netns_hosts.sh")
DISK = "/mnt/host-disk"


@dataclass
class Hosts:
    name: str
    count: int
    _started: list[subprocess.Popen] = field(default_factory=list)

    def _script(self, *args: str, timeout: int = 60) -> str:
        result = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"netns_hosts.sh {' '.join(args)}: {result.stderr}"
        return result.stdout.strip()

    def up(self) -> "Hosts":
        self._script("up", self.name, str(self.count))
        return self

    def down(self) -> None:
        for process in self._started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        self._script("down", self.name)

    def addr(self, host: int) -> str:
        """Host ``host``'s address (1-based); 0: this machine's address on the hosts' bridge."""
        return self._script("addr", self.name, str(host))

    def disk(self, host: int) -> str:
        """Where host ``host``'s disk (``DISK`` on that host) is, seen from this machine."""
        return self._script("disk", self.name, str(host))

    def command(self, host: int, cmd: list[str]) -> list[str]:
        return [SCRIPT, "exec", self.name, str(host), *cmd]

    def start(self, host: int, cmd: list[str], log: str, **env: str) -> subprocess.Popen:
        """Starts ``cmd`` on ``host`` in a session of its own, its output into ``log``."""
        with open(log, "w") as out:
            process = subprocess.Popen(
                self.command(host, cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=process_env(**env),
                start_new_session=True,
            )
        self._started.append(process)
        return process

    def kill(self, host: int) -> None:
        """SIGKILL to every process of ``host``: a host that dies."""
        self._script("kill", self.name, str(host))


def wait_all(processes: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit statuses of ``processes``; a test fails if any is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{process.args} still running after {timeout} s")
    return codes


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (scripts/netns_hosts.sh)")
    hosts = Hosts(f"t{os.getpid() % 100000}", 2).up()
    try:
        yield hosts
    finally:
        hosts.down()
