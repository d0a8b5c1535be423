"""Where an app's embedding tables live in its training module: :class:`TableModule`.

The shared machinery finds the tables by it (to fuse their optimizer, plan and shard them, read
the plan, and carry their optimizer states across shardings); each app names its own (the DLRM's
``EmbeddingBagCollection``, the HSTU's ``EmbeddingCollection``).
"""

import re
from dataclasses import dataclass

#: The kinds of TorchRec table collections -> the attribute their tables are held under, which
#: names the tables' weights in state dicts (``<path>.<attribute>.<table>.weight``).
TABLE_ATTRIBUTES = {
    "EmbeddingBagCollection": "embedding_bags",
    "EmbeddingCollection": "embeddings",
    # Managed-collision tables (apps/core/zch/): TorchRec's collection wrapped with the id-to-row maps.
    "ManagedCollisionEmbeddingBagCollection": "_embedding_module.embedding_bags",
    "ManagedCollisionEmbeddingCollection": "_embedding_module.embeddings",
}


@dataclass(frozen=True)
class TableModule:
    """A TorchRec table collection inside a training module: its dotted ``path`` (the key of the
    module in a sharding plan) and its ``kind`` (a key of :data:`TABLE_ATTRIBUTES`)."""

    path: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in TABLE_ATTRIBUTES:
            raise ValueError(f"table module kind {self.kind!r}: one of {', '.join(TABLE_ATTRIBUTES)}")

    @property
    def pooled(self) -> bool:
        """Whether its lookups pool each feature's ids into one vector (an EmbeddingBagCollection)."""
        return self.kind.endswith("EmbeddingBagCollection")

    @property
    def managed(self) -> bool:
        """Whether TorchRec's managed-collision modules map its ids to rows (``--categorical_ids zch``)."""
        return self.kind.startswith("ManagedCollision")

    def weight_key(self, table: str) -> str:
        """The key of ``table``'s weight in the (sharded or unsharded) model's state dict."""
        return f"{self.path}.{TABLE_ATTRIBUTES[self.kind]}.{table}.weight"

    def state_key_pattern(self) -> re.Pattern[str]:
        """Matches the key of a table's optimizer state in a flattened optimizer state dict
        (``state.<param group>.<weight key>.<state>``): groups ``table`` and ``state``."""
        weights = re.escape(f"{self.path}.{TABLE_ATTRIBUTES[self.kind]}")
        return re.compile(rf"^state\..+\.{weights}\.(?P<table>[^.]+)\.weight\.(?P<state>.+)$")
