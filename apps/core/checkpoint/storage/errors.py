"""The errors of checkpoint storage, each one line that says why and what to do.

They are their own module because every other one raises them, and the folder, the
checkpointer, the lease and the commands above them catch them: none of those needs the
readers or the writer to name a checkpoint's failure.
"""

import errno

from torch.distributed.checkpoint.api import CheckpointException

from apps.core.common.errors import ConfigError
from apps.core.urls import redact_urls


class CheckpointError(ConfigError):
    """A checkpoint location or checkpoint cannot be used; the message says why and what to do."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files are not what it recorded, or its .metadata does not add up: it is
    skipped as damaged (never resumed from), where a planted one refuses the whole location."""


class SaveFailed(CheckpointError):
    """A checkpoint could not be written (no space left); the committed ones are kept."""

    @classmethod
    def no_space(cls, folder: str, which: str) -> "SaveFailed":
        """The one line for a full disk (or quota) under ``folder``; ``which`` says what needed
        the space."""
        return cls(
            f"no space left on {redact_urls(folder)}{which}: free space there, or give --checkpoint_dir a "
            "disk with room; the committed checkpoints are kept"
        )


#: The errors of a write that found the disk (or the user's quota) full.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space_left(error: BaseException) -> bool:
    """Whether ``error`` is a write's running out of space, here or, within DCP's error of a save
    (which holds every rank's), on any rank."""
    if isinstance(error, CheckpointException):
        return any(no_space_left(failure) for failure, _ in error.failures.values())
    return isinstance(error, OSError) and error.errno in _NO_SPACE
