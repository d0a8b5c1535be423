"""URLs: which paths are remote, credentials written into URLs (``s3://KEY:SECRET@bucket``,
``sftp://user:pass@host/p``) never reaching a log line or a record (everything the app prints or
records passes through here), and an object store that cannot be reached at all said in one line.
"""

import contextlib
import glob
import os
import re
import urllib.parse
from typing import Any, Iterator

from apps.core.common.errors import ConfigError
from apps.core.options import option_values

#: How to give boto3 (s3fs, AWS Batch) credentials: its own sources, in the order it reads them.
AWS_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), run `aws configure`, "
    "or run where an IAM role gives them"
)

# A URL's scheme and user info: everything between "://" and the last "@" before the host's end
# (a "/" or whitespace), so that a password with an unescaped "@" is hidden whole.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")


def is_url(path: str) -> bool:
    """Whether ``path`` is a remote fsspec URL (``s3://``, ``gs://``, ...), not a local path."""
    return "://" in path and not path.startswith("file://")


def is_here(path: str) -> bool:
    """Whether ``path`` (a path, glob or URL) names something on this machine: a URL may need
    credentials that only a cluster has, and a path may be the cluster's own."""
    return not is_url(path) and bool(glob.glob(path.removeprefix("file://")))


def redact_urls(text: str) -> str:
    """``text`` with the user info of every URL in it replaced by ``***``.

    ``s3://KEY:SECRET@bucket/x`` becomes ``s3://***@bucket/x``; the rest, and text without
    URLs, is unchanged, so a message still names the location it is about.
    """
    return _USERINFO.sub(r"\g<scheme>***@", text)


def config_record(config: Any) -> dict[str, Any]:
    """The dataclass ``config`` as summary.json and manifest.json record it: every option as
    given, but with the credentials of URL options (--data_path, --checkpoint_dir) redacted."""
    return {
        name: redact_urls(value) if isinstance(value, str) else value for name, value in option_values(config).items()
    }


def unreachable_aws_fix(error: BaseException) -> str | None:
    """What to do where ``error`` says that this machine cannot talk to AWS (S3, Batch) at all:
    botocore found no credentials, or the endpoint refused the connection; None for any other error.

    boto3 (under s3fs) raises these as its own exceptions, not OSErrors, so the app's checks of a
    location (a missing bucket, no permission) let them through as tracebacks.
    """
    if not type(error).__module__.startswith("botocore"):
        return None
    from botocore import exceptions  # imported by the failed call already; slow to import otherwise

    if isinstance(error, (exceptions.NoCredentialsError, exceptions.PartialCredentialsError)):
        return f"no AWS credentials were found: {AWS_CREDENTIALS_FIX}"
    if isinstance(error, exceptions.EndpointConnectionError):
        parts = urllib.parse.urlsplit(str(error.kwargs.get("endpoint_url", "")))
        configured = os.environ.get("AWS_ENDPOINT_URL")
        setting = f"AWS_ENDPOINT_URL={configured}" if configured else "AWS_ENDPOINT_URL (unset: AWS itself)"
        return redact_urls(
            f"the endpoint {parts.scheme}://{parts.netloc} refuses the connection: check {setting} "
            "and that the server is up"
        )
    return None


@contextlib.contextmanager
def reaching(option: str, url: str) -> Iterator[None]:
    """Turns the errors of an object store that cannot be reached (see unreachable_aws_fix),
    raised while the block reads ``url`` (given as ``option``), into a one-line ConfigError naming
    the option, the URL (credentials redacted) and the fix."""
    try:
        yield
    except Exception as e:
        fix = unreachable_aws_fix(e)
        if fix is None:
            raise
        raise ConfigError(redact_urls(f"{option} {url} cannot be reached: {fix}")) from None
