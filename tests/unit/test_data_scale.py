"""Several token files at scale: they are served as one stream without being joined in memory,
and give exactly the batches of a naive np.concatenate of the files (the reference)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, PackedSequences, TrainLoader, build_token_streams
from moefold.data import corpus
from moefold.data.loader import val_batches
from moefold.errors import DataError

BYTES = ByteTokenizer()
VOCAB = 100_000


def _write_files(root: Path, specs: list[tuple[str, str, int]], seed: int = 0) -> np.ndarray:
    """Writes (name, dtype, length) token files of random ids below 120 (int8 holds them); returns
    the naive reference: the files read whole, in sorted name order, joined by np.concatenate."""
    generator = np.random.default_rng(seed)
    arrays = {}
    for name, dtype, length in specs:
        ids_N = generator.integers(0, 120, length).astype(dtype)
        if name.endswith(".npy"):
            np.save(root / name, ids_N)
        else:
            ids_N.tofile(root / name)
        arrays[name] = ids_N
    return np.concatenate([arrays[name] for name in sorted(arrays)])


def _streams(root: Path, val_fraction: float, **overrides):
    cfg = DataConfig(path=str(root), val_fraction=val_fraction, eos_id=3, **overrides)
    return build_token_streams(cfg, BYTES, vocab_size=VOCAB)


MIXED = [("a.npy", "int64", 50), ("b.bin", "uint16", 5), ("c.npy", "uint8", 37),
         ("d.npy", "int32", 3), ("e.npy", "uint16", 61), ("f.bin", "uint16", 29)]
"""Mixed dtypes; b (5 tokens) and d (3) are shorter than a window, so some windows span 3 files."""


@pytest.mark.parametrize("seq_len", [1, 4, 7, 16])
def test_several_token_files_give_the_batches_of_one_concatenated_stream(tmp_path, seq_len):
    reference_N = _write_files(tmp_path, MIXED)
    streams = _streams(tmp_path, val_fraction=0.15)
    num_val = round(len(reference_N) * 0.15)
    train_N, val_N = reference_N[:-num_val], reference_N[-num_val:]  # the same validation tail
    assert len(streams.train_N) == len(train_N) and len(streams.val_N) == len(val_N)
    assert np.asarray(streams.train_N).tolist() == train_N.tolist()
    assert streams.val_N.tolist() == val_N.tolist()
    ours = PackedSequences(streams.train_N, seq_len)
    assert len(ours) == (len(train_N) - 1) // seq_len
    for i in range(len(ours)):  # every window, several across file boundaries
        assert ours[i].tolist() == train_N[i * seq_len:i * seq_len + seq_len + 1].tolist()
    loader = TrainLoader(ours, 4, seed=5, eos_id=3, vocab=streams.vocab, step_size=8)
    naive = TrainLoader(PackedSequences(train_N, seq_len), 4, seed=5, eos_id=3, step_size=8)
    for _ in range(3 * len(ours) // 4):  # a few epochs
        got, want = next(loader), next(naive)
        for name in ("input_ids_BS", "labels_BS", "doc_ids_BS"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype
    got_val = val_batches(PackedSequences(streams.val_N, seq_len), 2, 3, 3)
    want_val = val_batches(PackedSequences(val_N, seq_len), 2, 3, 3)
    assert [torch.equal(a.input_ids_BS, b.input_ids_BS) and torch.equal(a.labels_BS, b.labels_BS)
            for a, b in zip(got_val, want_val, strict=True)] == [True] * len(want_val)


def test_slices_of_the_joined_stream_read_like_array_slices(tmp_path):
    reference_N = _write_files(tmp_path, MIXED, seed=1)
    stream = _streams(tmp_path, val_fraction=0.0).train_N
    n = len(reference_N)
    for start, stop in [(0, n), (49, 56), (50, 55), (55, 58), (54, 59), (10, 10), (n, n),
                        (n - 1, n + 5), (-7, None), (None, -100), (90, 20)]:
        part = stream[start:stop]
        assert np.asarray(part).tolist() == reference_N[start:stop].tolist(), (start, stop)
        assert len(part) == len(reference_N[start:stop])
    assert np.asarray(stream[40:90][5:12]).tolist() == reference_N[45:52].tolist()


def test_several_token_files_are_not_copied_into_memory(tmp_path):
    """np.concatenate held the whole stream on every rank (20 GB for 10^10 uint16 tokens, times
    8 ranks a node); the files now stay on disk and a batch reads only its windows."""
    _write_files(tmp_path, [(f"{i}.npy", "uint16", 1_000_000) for i in range(3)])
    stream_bytes = 3_000_000 * 2
    tracemalloc.start()
    try:
        streams = _streams(tmp_path, val_fraction=0.01)
        loader = TrainLoader(PackedSequences(streams.train_N, 64), 16, seed=0, eos_id=3,
                             vocab=streams.vocab)
        for _ in range(4):
            next(loader)
        val_batches(PackedSequences(streams.val_N, 64), 16, 2, 3, vocab=streams.vocab)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < stream_bytes / 20, (
        f"peak {peak / 1e6:.1f} MB for a {stream_bytes / 1e6} MB stream")


@pytest.mark.parametrize("dtypes", [("uint64", "int64"), ("int8", "uint64"), ("uint64", "uint8"),
                                    ("uint32", "int16"), ("uint16", "int64")])
def test_mixed_integer_files_serve_integer_ids(tmp_path, dtypes):
    """uint64 with a signed type is float64 for NumPy's promotion: 8 bytes per id, and ids that
    are floats. Served ids are integers in every mix."""
    reference_N = _write_files(tmp_path, [("a.npy", dtypes[0], 40), ("b.npy", dtypes[1], 30)])
    streams = _streams(tmp_path, val_fraction=0.0)
    assert streams.train_N.dtype.kind in "iu"
    sequences = PackedSequences(streams.train_N, 9)
    assert sequences.window(4).dtype.kind in "iu"  # crosses from a.npy into b.npy
    assert sequences.window(4).tolist() == reference_N[36:46].tolist()


@pytest.mark.parametrize("bad", [2**53 + 1, 2**62, 2**63 + 5])
def test_ids_beyond_the_vocabulary_in_a_uint64_file_are_refused_by_the_batch(tmp_path,
                                                                            monkeypatch, bad):
    """Past the startup check (each file's head) a batch refuses them, as before, naming the id
    exactly (float64 named 2**53 + 1 as 2**53; int64 named 2**63 + 5 as a negative id)."""
    monkeypatch.setattr(corpus, "_VOCAB_CHECK_TOKENS", 4)
    ids_N = np.arange(40, dtype=np.uint64)
    ids_N[20] = bad
    np.save(tmp_path / "a.npy", ids_N)
    np.save(tmp_path / "b.npy", np.arange(30, dtype=np.int64))
    streams = _streams(tmp_path, val_fraction=0.0)
    loader = TrainLoader(PackedSequences(streams.train_N, 68), 1, seed=0, eos_id=3,
                         vocab=streams.vocab)
    with pytest.raises(DataError, match=f"token id {bad} .*outside the vocabulary"):
        next(loader)


def test_a_negative_id_in_a_mix_is_refused_by_the_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_VOCAB_CHECK_TOKENS", 4)
    np.save(tmp_path / "a.npy", np.arange(40, dtype=np.uint64))
    ids_N = np.arange(30, dtype=np.int8)
    ids_N[10] = -7
    np.save(tmp_path / "b.npy", ids_N)
    streams = _streams(tmp_path, val_fraction=0.0)
    loader = TrainLoader(PackedSequences(streams.train_N, 68), 1, seed=0, eos_id=3,
                         vocab=streams.vocab)
    with pytest.raises(DataError, match="token id -7 in a training batch is outside"):
        next(loader)
