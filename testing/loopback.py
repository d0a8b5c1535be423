"""Starting a server program of the test venv on a free port of a local address (loopback, or
this machine's address on the test hosts' bridge), for the tests' fixtures."""

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Iterator

from apps.core.common.distributed import free_port


@contextlib.contextmanager
def loopback_server(
    program: str, args: Callable[[int], list[str]], ready_path: str, host: str = "127.0.0.1"
) -> Iterator[str]:
    """Runs ``program args(port)`` until the block ends; yields ``http://HOST:PORT`` once
    ``ready_path`` answers. ``args`` must make the program listen on ``host``."""
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), program), *args(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://{host}:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + ready_path, timeout=2).read()
            break
        except OSError as e:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError(f"{program} did not start") from e
            time.sleep(0.2)
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)
