"""Starting a server program of the test venv on a free loopback port, for the tests' fixtures."""

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Iterator

from apps.dlrm.distributed import free_port


@contextlib.contextmanager
def loopback_server(program: str, args: Callable[[int], list[str]], ready_path: str) -> Iterator[str]:
    """Runs ``program args(port)`` until the block ends; yields ``http://127.0.0.1:PORT``
    once ``ready_path`` answers."""
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), program), *args(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + ready_path, timeout=2).read()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError(f"{program} did not start")
            time.sleep(0.2)
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)
