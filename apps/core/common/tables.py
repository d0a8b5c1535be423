"""Where an app's embedding tables live in its training module: :class:`Tables`, of one or more
:class:`TableModule` s.

The shared machinery finds the tables by it (to fuse their optimizer, plan and shard them, read
the plan, and carry their optimizer states across shardings); each app names its own (the DLRM's
``EmbeddingBagCollection``, the HSTU's ``EmbeddingCollection``; the DLRM's plain collection beside a
managed-collision one when only some columns are managed, ``--zch_columns``).
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
    module in a sharding plan), its ``kind`` (a key of :data:`TABLE_ATTRIBUTES`) and, where the app
    has more than one collection, the names of the ``tables`` it holds (None: every table that no
    other collection of the app holds)."""

    path: str
    kind: str
    tables: frozenset[str] | None = None

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


@dataclass(frozen=True)
class Tables:
    """An app's table collections (:class:`TableModule` each): what the shared machinery plans,
    shards, fuses the optimizer of and checkpoints. One collection, or several side by side (the
    DLRM's plain tables beside its managed-collision ones, as TorchRec manages all of a collection's
    tables or none): each table is held by exactly one, which :meth:`module_of` says."""

    modules: tuple[TableModule, ...]

    def __post_init__(self) -> None:
        if sum(module.tables is None for module in self.modules) != 1:
            raise ValueError(f"table modules {self.modules}: exactly one must hold the tables no other names")

    @classmethod
    def of(cls, path: str, kind: str) -> "Tables":
        """The tables of one collection."""
        return cls((TableModule(path, kind),))

    @property
    def paths(self) -> list[str]:
        """The collections' dotted paths (their keys in a sharding plan)."""
        return [module.path for module in self.modules]

    @property
    def pooled(self) -> bool:
        """Whether every collection pools each feature's ids into one vector."""
        return all(module.pooled for module in self.modules)

    @property
    def managed(self) -> bool:
        """Whether any collection's ids are mapped to rows by managed-collision modules."""
        return any(module.managed for module in self.modules)

    @property
    def kind(self) -> str:
        """The collections' kinds, for messages."""
        return " and ".join(module.kind for module in self.modules)

    def module_of(self, table: str) -> TableModule:
        """The collection that holds ``table``."""
        named = [module for module in self.modules if module.tables is not None and table in module.tables]
        return named[0] if named else next(module for module in self.modules if module.tables is None)

    def weight_key(self, table: str) -> str:
        """The key of ``table``'s weight in the (sharded or unsharded) model's state dict."""
        return self.module_of(table).weight_key(table)

    def match_state_key(self, key: str) -> re.Match[str] | None:
        """``key`` (of a flattened optimizer state dict) matched as a table's optimizer state by
        one collection's :meth:`TableModule.state_key_pattern` (groups ``table`` and ``state``), or None."""
        matches = (module.state_key_pattern().match(key) for module in self.modules)
        return next((match for match in matches if match is not None), None)
