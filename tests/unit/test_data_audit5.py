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


# ---------------------------------------------------------------------------------------------
# 3. Text corpora: the ids of a naive per-document tokenization, without holding them twice
# ---------------------------------------------------------------------------------------------


WORDS = ["hello", "world", "moe", "fold", "expert", "router"]


def _write_hf_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def _write_corpus(root: Path, seed: int = 0) -> None:
    """.txt files (one document each) and .jsonl files (one a line), some in subdirectories."""
    generator = np.random.default_rng(seed)

    def text() -> str:
        words = generator.choice(WORDS + ["x!", "\n"], generator.integers(1, 60))
        return " ".join(words)

    for f in range(5):
        (root / f"t{f}.txt").write_text(text())
    (root / "sub").mkdir()
    for f in range(3):
        lines = [json.dumps({"text": text()}) for _ in range(120)]
        (root / "sub" / f"d{f}.jsonl").write_text("\n".join(lines) + "\n")


def _naive_streams(root: Path, tokenizer, val_fraction: float) -> tuple[list[int], list[int]]:
    """Each document in name order, encoded alone with its EOS, on the side its name's CRC-32
    bucket (of 10,000) puts it."""
    import zlib

    threshold = max(1, round(val_fraction * 10_000)) if val_fraction > 0 else 0
    documents = []
    for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix()
        if path.suffix == ".txt":
            documents.append((name, path.read_text()))
        elif path.suffix == ".jsonl":
            for line_no, line in enumerate(path.read_text().splitlines(), start=1):
                documents.append((f"{name}:{line_no}", json.loads(line)["text"]))
    train, val = [], []
    for name, text in documents:
        held_out = zlib.crc32(name.encode()) % 10_000 < threshold
        (val if held_out else train).extend([*tokenizer.encode(text), tokenizer.eos_id])
    return train, val


@pytest.mark.parametrize("tokenizer_kind", ["bytes", "hf"])
@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.5])
def test_text_streams_hold_a_naive_tokenization(tmp_path, monkeypatch, tokenizer_kind,
                                                val_fraction):
    from moefold.data import HFTokenizer

    monkeypatch.setattr(corpus, "_ENCODE_BATCH", 7)  # batches that end mid-file
    root = tmp_path / "data"
    root.mkdir()
    _write_corpus(root)
    tokenizer = (BYTES if tokenizer_kind == "bytes"
                 else HFTokenizer(str(_write_hf_tokenizer(tmp_path / "tokenizer.json"))))
    streams = build_token_streams(DataConfig(path=str(root), val_fraction=val_fraction), tokenizer)
    train, val = _naive_streams(root, tokenizer, val_fraction)
    assert streams.train_N.tolist() == train
    assert streams.val_N.tolist() == val
    assert streams.train_N.dtype == np.uint16 and streams.val_N.dtype == np.uint16
    assert streams.train_docs == train.count(tokenizer.eos_id)
    assert streams.val_docs == val.count(tokenizer.eos_id)


def _peak_ratio(root: Path) -> float:
    """The traced peak while building the streams, over the bytes of the ids they hold."""
    import tracemalloc

    tracemalloc.start()
    try:
        streams = build_token_streams(DataConfig(path=str(root), val_fraction=0.02), BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / (streams.train_N.nbytes + streams.val_N.nbytes)


def test_text_streams_peak_near_their_ids_with_many_documents(tmp_path):
    """12 MB of ids from 24,000 .jsonl documents: a list of per-document arrays and their
    concatenation peaked at 2.3x."""
    generator = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefgh \n", dtype=np.uint8)
    for f in range(4):
        lines = [json.dumps({"text": letters[generator.integers(0, 10, n)].tobytes().decode()})
                 for n in generator.integers(20, 480, 6000)]
        (tmp_path / f"d{f}.jsonl").write_text("\n".join(lines) + "\n")
    assert _peak_ratio(tmp_path) < 1.3


def test_text_streams_peak_near_their_ids_with_large_documents(tmp_path):
    """24 MB of ids from twenty 600 kB .txt files: one tokenizer batch (1024 documents) held all
    their ids, and the check an int64 concatenation of them (5.0x the final ids)."""
    generator = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefgh \n", dtype=np.uint8)
    for f in range(20):
        (tmp_path / f"t{f:02}.txt").write_bytes(letters[generator.integers(0, 10, 600_000)])
    assert _peak_ratio(tmp_path) < 1.3


@pytest.mark.parametrize("val_fraction, moved", [(0.0001, "last to validation"),
                                                 (0.9999, "first to training")])
def test_a_side_the_hash_leaves_empty_takes_one_document(tmp_path, val_fraction, moved):
    import zlib

    texts = ["first doc", "second, longer document", "third"]
    lines = [json.dumps({"text": text}) for text in texts]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    buckets = [zlib.crc32(f"d.jsonl:{i}".encode()) % 10_000 for i in (1, 2, 3)]
    threshold = round(val_fraction * 10_000)
    assert all(b >= threshold for b in buckets) or all(b < threshold for b in buckets)
    docs = [[*text.encode(), BYTES.eos_id] for text in texts]
    streams = _streams(tmp_path, val_fraction)
    if moved == "last to validation":
        expected = (docs[0] + docs[1], docs[2], 2, 1)
    else:
        expected = (docs[0], docs[1] + docs[2], 1, 2)
    assert (streams.train_N.tolist(), streams.val_N.tolist(), streams.train_docs,
            streams.val_docs) == expected


def test_one_document_holds_out_its_last_tokens(tmp_path):
    (tmp_path / "input.txt").write_text("abcdefghij" * 10)  # 101 ids with its EOS
    streams = _streams(tmp_path, 0.1)
    ids = [*(b"abcdefghij" * 10), BYTES.eos_id]
    assert streams.train_N.tolist() == ids[:-10] and streams.val_N.tolist() == ids[-10:]
    assert (streams.train_docs, streams.val_docs) == (1, 1)


# ---------------------------------------------------------------------------------------------
# 2. Token files are joined as they are (documented): no EOS between them
# ---------------------------------------------------------------------------------------------


def test_token_files_are_joined_with_no_eos_between_them(tmp_path):
    a_N, b_N = np.array([5, 6, 3, 7, 8], np.uint16), np.array([9, 10, 3, 11], np.uint16)
    a_N.tofile(tmp_path / "a.bin")
    b_N.tofile(tmp_path / "b.bin")
    streams = _streams(tmp_path, eos_id=3)
    assert np.asarray(streams.train_N).tolist() == np.concatenate([a_N, b_N]).tolist()
    assert PackedSequences(streams.train_N, 4).window(1).tolist() == [8, 9, 10, 3, 11]


# ---------------------------------------------------------------------------------------------
# 4. CRLF: a document's characters are kept as written, in .txt and .jsonl alike
# ---------------------------------------------------------------------------------------------


def test_crlf_text_is_kept_alike_in_txt_and_jsonl(tmp_path):
    """A .txt file's CR LF are its text; a .jsonl's line endings are JSON whitespace and its
    text's escaped "\\r\\n" are text: the same document gives the same ids either way."""
    text = "first line\r\nsecond line\r\n"
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_bytes(text.encode())
    (tmp_path / "jsonl").mkdir()
    records = [json.dumps({"text": text}), json.dumps({"text": "lf\nonly"})]
    (tmp_path / "jsonl" / "a.jsonl").write_bytes("\r\n".join(records).encode() + b"\r\n")
    from_txt = _streams(tmp_path / "txt").train_N.tolist()
    from_jsonl = _streams(tmp_path / "jsonl").train_N.tolist()
    assert from_txt == [*text.encode(), BYTES.eos_id]
    assert from_jsonl == from_txt + [*b"lf\nonly", BYTES.eos_id]


# ---------------------------------------------------------------------------------------------
# 5. Exact duplicates are kept, each split by its own name (documented; dedup is preprocessing)
# ---------------------------------------------------------------------------------------------


def test_identical_documents_are_each_split_by_their_name(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join([json.dumps({"text": "same"})] * 20) + "\n")
    streams = _streams(tmp_path, 0.5)
    train, val = _naive_streams(tmp_path, BYTES, 0.5)
    assert streams.train_N.tolist() == train and streams.val_N.tolist() == val
    assert streams.train_docs + streams.val_docs == 20 and min(streams.train_docs,
                                                               streams.val_docs) > 0


@pytest.mark.parametrize("tokenizer_kind, before, bound", [("bytes", 2.5, 2.2), ("hf", 14.2, 12.5)])
def test_one_large_txt_file_peaks_below_its_old_peak(tmp_path, tokenizer_kind, before, bound):
    """One 2.6 MB .txt file (input.txt): its bytes were held beside its text while it was
    tokenized: `before` x the stream's bytes at the peak, 2.0x and 11.1x without them (the text
    alone is 0.5x with bytes, 3.1x with the word-level tokenizer)."""
    import tracemalloc

    from moefold.data import HFTokenizer

    generator = np.random.default_rng(0)
    words = np.array(WORDS + ["\n"])
    (tmp_path / "data").mkdir()
    text = " ".join(words[generator.integers(0, 7, 500_000)])
    (tmp_path / "data" / "input.txt").write_text(text)
    tokenizer = (BYTES if tokenizer_kind == "bytes"
                 else HFTokenizer(str(_write_hf_tokenizer(tmp_path / "tokenizer.json"))))
    tracemalloc.start()
    try:
        streams = build_token_streams(DataConfig(path=str(tmp_path / "data")), tokenizer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak / (streams.train_N.nbytes + streams.val_N.nbytes) < bound


# ---------------------------------------------------------------------------------------------
# Windows and orders against naive references
# ---------------------------------------------------------------------------------------------


def _naive_train_order(num_seqs: int, batch: int, step: int, seed: int, batches: int) -> list:
    """Epoch e's torch.randperm, whole steps of it (the rest dropped); a step longer than an
    epoch reads the epochs' orders back to back."""
    import torch

    def order(epoch):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
        return torch.randperm(num_seqs, generator=generator).tolist()

    flat, epoch = [], 0
    while len(flat) < batches * batch:
        ids = order(epoch)
        flat += ids if step > num_seqs else ids[:num_seqs // step * step]
        epoch += 1
    return [flat[i * batch:(i + 1) * batch] for i in range(batches)]


@pytest.mark.parametrize("num_tokens, seq_len, batch, step",
                         [(101, 4, 3, 6), (101, 4, 5, 5), (50, 7, 2, 8), (64, 3, 4, 4)])
def test_train_batches_are_naive_windows_in_the_naive_order(num_tokens, seq_len, batch, step):
    tokens_N = np.random.default_rng(1).integers(0, 250, num_tokens).astype(np.uint16)
    sequences = PackedSequences(tokens_N, seq_len)
    assert len(sequences) == (num_tokens - 1) // seq_len
    loader = TrainLoader(sequences, batch, seed=7, eos_id=256, step_size=step)
    for indices in _naive_train_order(len(sequences), batch, step, 7, 30):
        windows = [tokens_N[i * seq_len:i * seq_len + seq_len + 1].tolist() for i in indices]
        got = next(loader)
        assert got.input_ids_BS.tolist() == [w[:-1] for w in windows]
        assert got.labels_BS.tolist() == [w[1:] for w in windows]


@pytest.mark.parametrize("num_seqs, batch, num_batches, ranks",
                         [(20, 3, 4, 1), (20, 3, 4, 2), (20, 3, 5, 2), (5, 8, 2, 1), (9, 2, 10, 3)])
def test_val_batches_are_the_first_sequences_grouped_by_rank(num_seqs, batch, num_batches, ranks):
    seq_len = 4
    tokens_N = np.arange(num_seqs * seq_len + 1, dtype=np.uint16) % 250
    sequences = PackedSequences(tokens_N, seq_len)
    got = val_batches(sequences, batch, num_batches, 256, data_ranks=ranks)
    per_rank = min(batch, num_seqs)
    count = max(1, min(num_batches, num_seqs // per_rank)) * per_rank
    windows = [tokens_N[i * seq_len:i * seq_len + seq_len + 1].tolist() for i in range(count)]
    rows = per_rank * ranks
    expected = [windows[i:i + rows] for i in range(0, count, rows)]
    assert [b.input_ids_BS.tolist() for b in got] == [[w[:-1] for w in g] for g in expected]
    assert [b.labels_BS.tolist() for b in got] == [[w[1:] for w in g] for g in expected]


def test_document_ids_count_the_eos_before_each_position():
    import torch

    from moefold.data import make_batch

    windows_BS1 = torch.tensor([[5, 9, 9, 6, 9, 9, 7, 8], [9, 1, 2, 3, 4, 9, 5, 9]])
    batch = make_batch(windows_BS1, eos_id=9)
    naive = []
    for row in windows_BS1[:, :-1].tolist():
        doc, ids = 0, []
        for token in row:
            ids.append(doc)
            doc += token == 9
        naive.append(ids)
    assert batch.doc_ids_BS.tolist() == naive
    assert batch.doc_ids_BS.dtype == torch.int32


def test_a_txt_file_of_only_a_byte_order_mark_is_not_blamed_on_text_field(tmp_path):
    """data.text_field applies to .jsonl and .parquet records, not to a .txt file's text."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(DataError) as error:
        _streams(tmp_path)
    assert "text_field" not in str(error.value)
    assert "a.txt: no documents (only a UTF-8 byte-order mark)" in str(error.value)
