"""URLs: which paths are remote, and credentials written into URLs (``s3://KEY:SECRET@bucket``,
``sftp://user:pass@host/p``) never reaching a log line or a record: everything the app prints or
records passes through here.
"""

import re
from typing import Any

from apps.dlrm.options import option_values

# A URL's scheme and user info: everything between "://" and the last "@" before the host's end
# (a "/" or whitespace), so that a password with an unescaped "@" is hidden whole.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")


def is_url(path: str) -> bool:
    """Whether ``path`` is a remote fsspec URL (``s3://``, ``gs://``, ...), not a local path."""
    return "://" in path and not path.startswith("file://")


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
