"""The ids managed-collision tables take (see :mod:`apps.core.zch`): raw ids hashed into TorchRec's
input range, as every app's readers make them."""

import numpy as np

from apps.core.common.hashing import hashed_ids
from apps.core.zch.config import INPUT_HASH_SIZE


def input_ids(raw: np.ndarray) -> np.ndarray:
    """int64: the raw integer ids ``raw`` (any integer type) in ``[0, INPUT_HASH_SIZE)``, SplitMix64
    of each modulo it, as the DLRM's Parquet reader makes its zch ids."""
    return hashed_ids(raw, INPUT_HASH_SIZE).view(np.int64)
