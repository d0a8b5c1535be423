"""Library warnings that a user of this app can do nothing about, filtered in this one place.

Each is filtered by its exact message, so any other warning of the same libraries still shows.
Warnings we can avoid at their cause are avoided there instead (the planner's storage
reservation: :func:`apps.dlrm.sharding.storage_reservation`).
"""

import re
import warnings

#: (category, message) of each known warning, with why it cannot be avoided.
KNOWN_WARNINGS = (
    # TorchRec hands sharded embedding tables to DCP as ShardedTensors, and torch deprecates
    # ShardedTensor on each use while saving and loading a checkpoint, once per call site and
    # rank; the tables' type is TorchRec's choice, not this app's.
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
)


def filter_known_warnings() -> None:
    """Hides the :data:`KNOWN_WARNINGS` for the rest of this process."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
