"""A Google Cloud Storage emulator on loopback (gcp-storage-emulator), for gs:// URLs.

gcsfs talks to it as it talks to GCS, once STORAGE_EMULATOR_HOST points there.
"""

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from apps.dlrm.distributed import free_port


@pytest.fixture(scope="session")
def gcs_endpoint():
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator"), "start",
         "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/storage/v1/b", timeout=2).read()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError("gcp-storage-emulator did not start")
            time.sleep(0.2)
    yield endpoint
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def gcs(gcs_endpoint, monkeypatch):
    """gcsfs (and the trainers it starts) pointed at the emulator."""
    import gcsfs

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    # gcsfs's default filesystem first asks GCS's gRPC API for the bucket type, which an
    # emulator does not serve (a 60 s timeout each time); the plain one needs no such probe.
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    gcsfs.GCSFileSystem.clear_instance_cache()
    return gcs_endpoint
