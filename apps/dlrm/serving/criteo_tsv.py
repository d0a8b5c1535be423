"""Raw Criteo click logs (TSV, plain or gzip) made into the rows a model trained on their
preprocessed folder read, by the preprocessing's own parser and transforms.

A model trained on a folder of ``python -m apps.dlrm.preprocess`` (``--data criteo``) never saw
the click logs: it read dense
values log(1 + max(x, 0)) of the integers and ids that the folder's ``--categorical_ids`` made of
the 32-bit values: hash (the value modulo the folder's table size: no seed) or vocabulary (looked
up in the folder's ``vocabulary/`` tables). The folder's ``manifest.json`` records which, and its
table sizes (which may be smaller than the model's): it is the one record of the transform, so
scoring raw lines reads it (:class:`CriteoIds`), and, with vocabulary ids, the tables beside it.

Lines are parsed as preprocessing parses them (:func:`~apps.dlrm.data.criteo.parse.read_blocks`):
a line it skips (undecodable, empty, not 40 fields, a label other than 0 or 1) is skipped and
counted by kind, a field it repairs is read as missing, so a kept line scores as its preprocessed
row does. Only lines of the training logs' form are read: the label first (unlabelled lines of 39
fields are ``wrong_column_count``).
"""

import os
import posixpath
from dataclasses import dataclass
from typing import Iterator

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from apps.core.common.errors import ConfigError
from apps.core.urls import reaching, redact_urls
from apps.dlrm.data.criteo.convert import dense_features, hashed_ids, printable
from apps.dlrm.data.criteo.layout import MANIFEST, VOCABULARY_DIR, check_table_sizes, parse_manifest
from apps.dlrm.data.criteo.parse import LineCounts, read_blocks
from apps.dlrm.data.criteo.sources import open_lines
from apps.dlrm.data.criteo.vocabulary import Vocabulary, table_files

#: The option that names the preprocessed folder when the training run's is not the one to read.
PREPROCESSED_OPTION = "--preprocessed_path"
#: What prediction counts as repaired when a line holds a value its vocabulary does not.
NOT_IN_VOCABULARY = "value_not_in_vocabulary"
_FIX = (
    f"give {PREPROCESSED_OPTION}: the folder `python -m apps.dlrm.preprocess --output` wrote, that the model "
    "trained on (or a copy: its manifest.json, and vocabulary/ with vocabulary ids)"
)


@dataclass
class Block:
    """Parsed lines of a click log as the preprocessed folder holds them."""

    dense: np.ndarray  #: float32 [rows, 13]
    ids: np.ndarray  #: int32 [rows, 26], table rows
    labels: np.ndarray  #: int32 [rows]
    unseen: np.ndarray  #: bool [rows]: which held a value the vocabulary was not built from

    def __len__(self) -> int:
        return len(self.labels)

    def split(self, rows: int) -> tuple["Block", "Block"]:
        """The first ``rows`` rows, and the others."""
        head, tail = zip(*((array[:rows], array[rows:]) for array in vars(self).values()))
        return Block(*head), Block(*tail)

    @classmethod
    def join(cls, blocks: list["Block"]) -> "Block":
        if len(blocks) == 1:
            return blocks[0]
        return cls(*(np.concatenate(arrays) for arrays in zip(*(vars(block).values() for block in blocks))))


class CriteoIds:
    """How the preprocessed folder at ``url`` made categorical values into ids (its manifest's
    ``categorical_ids`` and table sizes, its vocabulary), checked against the model's tables.
    ``given`` says where ``url`` came from, for messages."""

    def __init__(self, url: str, given: str, model_tables: list[int]) -> None:
        self.where = f"{given} {redact_urls(url)}"
        fs, root = fsspec.core.url_to_fs(url)
        manifest = self._manifest(fs, root, url, given)
        self.categorical_ids = manifest.get("categorical_ids")
        sizes = manifest.get("num_embeddings_per_feature")
        if self.categorical_ids not in ("hash", "vocabulary") or not isinstance(sizes, list):
            raise ConfigError(f"{self.where} records no categorical_ids and table sizes in its {MANIFEST}: {_FIX}")
        check_table_sizes(sizes, model_tables, self.where)
        self.table_sizes = np.array(sizes, dtype=np.uint32)
        self.vocabulary = self._vocabulary(fs, root) if self.categorical_ids == "vocabulary" else None

    def _manifest(self, fs: fsspec.AbstractFileSystem, root: str, url: str, given: str) -> dict:
        path = posixpath.join(root, MANIFEST)
        try:
            with reaching(given, url), fs.open(path, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(
                f"{self.where} holds no {MANIFEST}: it is not (or no longer) a folder of `python -m "
                f"apps.dlrm.preprocess`, whose manifest says how the click logs' values became ids: {_FIX}"
            ) from None
        except OSError as e:
            raise ConfigError(f"{self.where}: {MANIFEST} cannot be read ({type(e).__name__}: {e}): {_FIX}") from None
        return parse_manifest(text, f"{self.where}/{MANIFEST}", _FIX)

    def _vocabulary(self, fs: fsspec.AbstractFileSystem, root: str) -> Vocabulary:
        folder = os.path.join(root, VOCABULARY_DIR)
        missing = [path for f in range(len(self.table_sizes)) for path in table_files(folder, f) if not fs.exists(path)]
        if not isinstance(fs, LocalFileSystem) or missing:
            why = f"has no {os.path.relpath(missing[0], root)}" if missing else "is not a local folder"
            raise ConfigError(
                f"{self.where} made its ids with --categorical_ids vocabulary, and {why}: the vocabulary's tables "
                f"are memory-mapped; {_FIX}"
            )
        return Vocabulary(folder)

    def blocks(self, url: str, counts: LineCounts, rows: int) -> Iterator[Block]:
        """The kept lines of the click log ``url`` (plain or gzip, any fsspec URL) in blocks of
        ``rows`` (the last one fewer), ``counts`` counting what was skipped and repaired. Blocks of
        the rows a preprocessed day is scored in: batches of the same rows then score to the same
        bits (the kernels' sums may take another order in a batch cut elsewhere). A file that
        cannot be read is a one-line ConfigError naming it."""
        pending: list[Block] = []
        for block in self._parsed(url, counts):
            pending.append(block)
            while sum(map(len, pending)) >= rows:
                whole, rest = Block.join(pending).split(rows)
                yield whole
                pending = [rest]
        if sum(map(len, pending)):
            yield Block.join(pending)

    def _parsed(self, url: str, counts: LineCounts) -> Iterator[Block]:
        """The kept lines of ``url`` in the blocks the parser makes."""
        try:
            with open_lines(url) as (stream, _):
                for rows in read_blocks(stream, counts):
                    yield self._block(rows.ints, rows.cats, rows.labels)
        except ConfigError:
            raise
        except Exception as e:  # a corrupt gzip stream, a read error: no line of it is quoted
            raise ConfigError(
                printable(
                    f"{redact_urls(url)} cannot be read as a Criteo click log ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}): fix or leave out the file (--data_path)"
                )
            ) from None

    def _block(self, ints: np.ndarray, cats: np.ndarray, labels: np.ndarray) -> Block:
        if self.vocabulary is None:
            unseen = np.zeros(len(labels), dtype=bool)
            return Block(dense_features(ints), hashed_ids(cats, self.table_sizes), labels, unseen)
        ids, unseen = self.vocabulary.lookup_or_rare(cats.T, self.table_sizes)  # a view: column f is row f
        return Block(dense_features(ints), ids, labels, unseen)
