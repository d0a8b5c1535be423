"""Cross-check with TorchRec's own Criteo utilities, on the same generated click logs.

Where the layouts coincide the outputs must be equal: labels; categorical ids (TorchRec keeps the
raw 32-bit values and takes them modulo the table size when it loads them; its vocabulary is
``sparse_to_contiguous``); the integer values behind the dense features (TorchRec 1.8 takes the
log of x - min + 2 where we take log(1 + max(x, 0)), so the integers both read are compared, and
our dense values must be exactly our transform of TorchRec's integers). And TorchRec's binary
Criteo loader reads our files as they are.
"""

import os

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

from apps.core.data import RankShare
from apps.dlrm.config import train_config
from apps.dlrm.data.criteo.config import PreprocessConfig
from apps.dlrm.data.criteo.loader import CriteoClickLogs
from apps.dlrm.data.criteo.pipeline import preprocess
from testing.criteo_files import generate_day, write_day

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

DAYS = 3
SIZES = [50_000] * 26
SIZES[0], SIZES[5], SIZES[9] = 37, 3, 1000


@pytest.fixture(scope="module")
def torchrec_npys(tmp_path_factory):
    """Valid generated days (TorchRec's parser has no bad-line handling) and TorchRec's npys."""
    raw = tmp_path_factory.mktemp("raw")
    theirs = tmp_path_factory.mktemp("torchrec")
    days = [generate_day(1200, seed, malformed=False) for seed in range(DAYS)]
    for d, day in enumerate(days):
        write_day(day, raw / f"day_{d}")
        BinaryCriteoUtils.tsv_to_npys(
            str(raw / f"day_{d}"), *(str(theirs / f"day_{d}_{part}.npy") for part in ("dense", "sparse", "labels"))
        )
    return days, raw, theirs


def ours(raw, output, **kwargs):
    preprocess(
        PreprocessConfig(input=[str(raw)], output=str(output), num_embeddings_per_feature=SIZES, workers=2, **kwargs)
    )
    return output


def test_hashed_ids_labels_and_integers_equal_torchrec(torchrec_npys, tmp_path):
    days, raw, theirs = torchrec_npys
    out = ours(raw, tmp_path / "out")
    for d, day in enumerate(days):
        their_labels = np.load(theirs / f"day_{d}_labels.npy")
        np.testing.assert_array_equal(np.load(out / f"day_{d}_labels.npy"), their_labels)
        their_sparse = np.load(theirs / f"day_{d}_sparse.npy")
        np.testing.assert_array_equal(np.load(out / f"day_{d}_sparse.npy"), their_sparse % np.array(SIZES))
        # TorchRec: log(x - min + 2), min over the day's integers (missing values are 0).
        ints = day.arrays()[1]
        their_ints = np.rint(np.exp(np.load(theirs / f"day_{d}_dense.npy").astype(np.float64)))
        their_ints = their_ints.astype(np.int64) + min(ints.min(), 0) - 2
        np.testing.assert_array_equal(their_ints, ints)
        ours_from_theirs = np.log((np.maximum(their_ints, 0) + 1).astype(np.float32), dtype=np.float32)
        np.testing.assert_array_equal(np.load(out / f"day_{d}_dense.npy"), ours_from_theirs)


def test_vocabulary_ids_equal_torchrec_sparse_to_contiguous(torchrec_npys, tmp_path):
    _, raw, theirs = torchrec_npys
    out = ours(raw, tmp_path / "out", categorical_ids="vocabulary", frequency_threshold=3)
    contiguous = tmp_path / "contiguous"
    contiguous.mkdir()
    BinaryCriteoUtils.sparse_to_contiguous(
        [str(theirs / f"day_{d}_sparse.npy") for d in range(DAYS)], str(contiguous), frequency_threshold=3
    )
    for d in range(DAYS):
        expected = np.load(contiguous / f"day_{d}_sparse_contig_freq.npy") % np.array(SIZES)
        np.testing.assert_array_equal(np.load(out / f"day_{d}_sparse.npy"), expected)
        assert (expected[:, 1] == 1).any() and (expected[:, 1] > 1).any()  # rare and frequent values
    assert not os.path.exists(out / "vocabulary" / "day_0_values.npy")  # replaced by the ids


def test_torchrec_binary_loader_reads_our_files_as_our_loader_does(torchrec_npys, tmp_path):
    _, raw, _ = torchrec_npys
    out = ours(raw, tmp_path / "out")
    paths = {part: [str(out / f"day_{d}_{part}.npy") for d in range(DAYS)] for part in ("dense", "sparse", "labels")}
    cfg = train_config(data="criteo", data_path=str(out), num_embeddings_per_feature=SIZES, batch_size=128)
    mine = CriteoClickLogs(cfg.model, cfg.data, RankShare.of(cfg.training), str(out), pin_memory=False)
    for split in ("val", "test"):
        # TorchRec's val and test: the halves of the last day, as ours with --eval_days 1. Our ids
        # are already below the table sizes, so its modulo by `hashes` changes none of them;
        # torchrec 1.6.1 fails without them, 1.8.0 does not.
        theirs = InMemoryBinaryCriteoIterDataPipe(
            split,
            paths["dense"][-1:],
            paths["sparse"][-1:],
            paths["labels"][-1:],
            batch_size=128,
            rank=0,
            world_size=1,
            hashes=SIZES,
        )
        pairs = list(zip(theirs, mine.eval_batches(split, 0), strict=True))
        assert len(pairs) == 5  # 600 rows: 4 batches of 128 and one of 88
        for a, b in pairs:
            torch.testing.assert_close(a.dense_features, b.dense_features, rtol=0, atol=0)
            assert torch.equal(a.sparse_features.values().long(), b.sparse_features.values().long())
            assert a.sparse_features.keys() == b.sparse_features.keys()
            assert torch.equal(a.labels.float(), b.labels)
