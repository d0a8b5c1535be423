"""A real AWS API server (moto's server mode) on loopback, for S3, Batch and CloudWatch Logs.

Tests talk to it through boto3/s3fs exactly as they would talk to AWS: only the endpoint and
the (dummy) credentials come from the environment.
"""

import contextlib
import json
import urllib.request
from typing import Iterator

import pytest

from testing.loopback import loopback_server

REGION = "us-west-2"  # not us-east-1: moto refuses a LocationConstraint there


def _post(url: str, body: dict | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST")
    urllib.request.urlopen(request, timeout=10).read()


@contextlib.contextmanager
def moto_server(host: str = "127.0.0.1") -> Iterator[str]:
    """moto_server listening on ``host`` until the block ends; yields its endpoint URL."""
    with loopback_server("moto_server", lambda port: ["-H", host, "-p", str(port)], "/moto-api/", host) as endpoint:
        # No Docker engine here: Batch jobs must not try to start containers.
        _post(endpoint + "/moto-api/config", {"batch": {"use_docker": False}})
        yield endpoint


def aws_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables, pointing at the moto server at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@pytest.fixture(scope="session")
def moto_endpoint():
    """Starts moto_server once per session; yields its endpoint URL."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def aws(moto_endpoint, monkeypatch):
    """A clean AWS account on the loopback server; the standard AWS variables point at it."""
    _post(moto_endpoint + "/moto-api/reset")
    # fsspec reuses S3 filesystem instances, with their listings of the account just reset.
    # Imported here: the gpu-tier tests run where s3fs is not installed (the lent GPU machines'
    # image), and this module is a plugin of every test session.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    _post(moto_endpoint + "/moto-api/config", {"batch": {"use_docker": False}})
    env = aws_env(moto_endpoint)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
