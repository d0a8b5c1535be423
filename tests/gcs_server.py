"""A Google Cloud Storage emulator on loopback (gcp-storage-emulator), for gs:// URLs.

gcsfs talks to it as it talks to GCS, once STORAGE_EMULATOR_HOST points there.
"""

import pytest

from testing.loopback import loopback_server


@pytest.fixture(scope="session")
def gcs_endpoint():
    """Starts gcp-storage-emulator once per session; yields its endpoint URL."""
    with loopback_server(
        "gcp-storage-emulator",
        lambda port: ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        "/storage/v1/b",
    ) as endpoint:
        yield endpoint


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
