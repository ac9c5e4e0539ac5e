"""Audit of moefold.data (fifth pass) against naive references: Python ints for uint64 ids, a
naive per-document tokenization for the text streams (and tracemalloc for its peak), naive
np.concatenate and slicing for token files and windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, PackedSequences, TrainLoader, build_token_streams
from moefold.data import corpus
from moefold.data.loader import val_batches
from moefold.errors import DataError

BYTES = ByteTokenizer()
VOCAB = 100_000


def _streams(root: Path, val_fraction: float = 0.0, **overrides):
    cfg = DataConfig(path=str(root), val_fraction=val_fraction, **overrides)
    return build_token_streams(cfg, BYTES, vocab_size=VOCAB)


# ---------------------------------------------------------------------------------------------
# 1. A uint64 id past 2**63 is named by its value, not as the negative int64 it casts to
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("second", [None, "int64", "uint8"])
@pytest.mark.parametrize("split", ["training", "validation"])
def test_a_uint64_id_past_2_63_is_named_by_its_value(tmp_path, monkeypatch, second, split):
    monkeypatch.setattr(corpus, "_VOCAB_CHECK_TOKENS", 4)  # past the startup check: the batch's
    bad = 2**63 + 5
    ids_N = np.arange(40, dtype=np.uint64)
    ids_N[20] = bad
    np.save(tmp_path / "a.npy", ids_N)
    if second:
        np.save(tmp_path / "b.npy", np.arange(30, dtype=second))
    streams = _streams(tmp_path, eos_id=3)
    sequences = PackedSequences(streams.train_N, 30)
    with pytest.raises(DataError, match=f"token id {bad} in a {split} batch is outside"):
        if split == "training":
            next(TrainLoader(sequences, len(sequences), seed=0, eos_id=3, vocab=streams.vocab))
        else:
            val_batches(sequences, len(sequences), 1, 3, vocab=streams.vocab)
