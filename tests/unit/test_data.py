"""Tests of moefold.data against naive references: tokenizers, corpus formats, packing, loaders."""

from __future__ import annotations

import json
import random
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from data_reading import BYTES, EOS, byte_doc, streams_of

from moefold.config import DataConfig, field_docs
from moefold.data import (Batch, ByteTokenizer, HFTokenizer, PackedSequences, TrainLoader,
                          Vocabulary, build_token_streams, build_tokenizer, make_batch,
                          val_batches)
from moefold.data import corpus
from moefold.data.formats import find_data_files, stdlib_files
from moefold.data.token_files import ConcatenatedTokens
from moefold.errors import DataError


def write_hf_tokenizer(path: Path, special=("<|endoftext|>",)) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


UNICODE_TEXTS = ["", "hello", "naïve café ∑ 日本語 🤖🧪", "a\x00b\n\t\r", "é" * 1000]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_byte_tokenizer_round_trips(text):
    ids = BYTES.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert BYTES.encode_np(text).tolist() == ids
    assert BYTES.decode(ids) == text
    assert BYTES.decode(torch.tensor(ids + [EOS], dtype=torch.int64)) == text


def test_byte_tokenizer_decode_skips_eos_and_replaces_bad_bytes():
    assert BYTES.decode([104, EOS, 105]) == "hi"
    assert BYTES.decode([0xFF, 104]) == "\ufffdh"
    assert isinstance(build_tokenizer(""), ByteTokenizer)
    assert (BYTES.vocab_size, BYTES.eos_id, BYTES.name) == (257, 256, "bytes")


def test_hf_tokenizer(tmp_path):
    path = write_hf_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = build_tokenizer(str(path))
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (4, 3)
    assert tokenizer.encode("hello world hello") == [1, 2, 1]
    assert tokenizer.decode([1, 2, 3, 1]) == "hello world hello"
    # A document spelling the EOS token must not produce an EOS id.
    assert 3 not in tokenizer.encode("hello <|endoftext|>")


def test_hf_tokenizer_eos_preference_and_absence(tmp_path):
    path = write_hf_tokenizer(tmp_path / "a.json", special=("<eos>", "</s>"))
    assert HFTokenizer(str(path)).eos_id == 4  # "</s>" comes before "<eos>" in the preference
    path = write_hf_tokenizer(tmp_path / "b.json", special=("<pad>",))
    with pytest.raises(DataError, match=r"data\.tokenizer=.*b\.json: no end-of-document token"):
        HFTokenizer(str(path))


def test_hf_tokenizer_deepseek_eos(tmp_path):
    # As spelled in DeepSeek-V3's tokenizer.json: fullwidth bars (U+FF5C), U+2581 for spaces.
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    assert eos == "<\uff5cend\u2581of\u2581sentence\uff5c>"
    path = write_hf_tokenizer(tmp_path / "tokenizer.json", special=(bos, eos))
    assert HFTokenizer(str(path)).eos_id == 4


@pytest.mark.parametrize("eos_token", ["<|eot|>", {"content": "<|eot|>", "special": True}])
def test_hf_tokenizer_eos_from_tokenizer_config(tmp_path, eos_token):
    path = write_hf_tokenizer(tmp_path / "tokenizer.json", special=("<pad>", "<|eot|>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    assert HFTokenizer(str(path)).eos_id == 4


def test_hf_tokenizer_config_eos_comes_after_the_candidates(tmp_path):
    # A Qwen instruct config names <|im_end|>, a chat-turn end; <|endoftext|> separates documents.
    path = write_hf_tokenizer(tmp_path / "tokenizer.json", special=("<|endoftext|>", "<|im_end|>"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    assert HFTokenizer(str(path)).eos_id == 3


@pytest.mark.parametrize("config, expected", [
    ('{"eos_token": "<|eot|>"}', "eos_token '<|eot|>' of tokenizer_config.json"),
    ("{oops", "tokenizer_config.json: not valid JSON"),
    ("[1]", "tokenizer_config.json: not a JSON object"),
])
def test_hf_tokenizer_config_eos_errors(tmp_path, config, expected):
    path = write_hf_tokenizer(tmp_path / "tokenizer.json", special=("<pad>",))
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(DataError) as info:
        HFTokenizer(str(path))
    message = str(info.value)
    assert message.startswith(f"data.tokenizer={path}: ") and expected in message, message
    assert "\n" not in message


@pytest.mark.parametrize("content", [None, "{not json", '{"version": "1.0"}'])
def test_hf_tokenizer_bad_file(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as info:
        build_tokenizer(str(path))
    assert str(info.value).startswith(f"data.tokenizer={path}: ")
    assert "\n" not in str(info.value)


def test_a_tokenizer_directory_is_named_as_one(tmp_path):
    with pytest.raises(DataError) as info:
        build_tokenizer(str(tmp_path))
    assert str(info.value) == (f"data.tokenizer={tmp_path}: a directory; give the tokenizer.json "
                               f"file itself (such as {tmp_path / 'tokenizer.json'})")


def test_hf_tokenizer_without_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match=r"data\.tokenizer=.*moefold\[hf\]"):
        HFTokenizer(str(tmp_path / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# The embedded corpus
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_streams():
    return build_token_streams(DataConfig(), BYTES)


def test_stdlib_corpus_is_deterministic_and_seed_free(stdlib_streams):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    again = build_token_streams(DataConfig(), BYTES)
    assert np.array_equal(again.train_N, stdlib_streams.train_N)
    assert np.array_equal(again.val_N, stdlib_streams.val_N)
    assert stdlib_streams.train_N.dtype == np.uint16
    assert "stdlib" in stdlib_streams.source and "files" in stdlib_streams.source


def test_stdlib_split_by_name(stdlib_streams):
    files = stdlib_files()
    names = [f.name for f in files]
    assert names == sorted(names) and len(names) > 100
    assert not any("site-packages" in n or "dist-packages" in n for n in names)
    val_files = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 < 200]
    train_files = [f for f in files if f not in val_files]
    assert val_files and train_files
    assert (stdlib_streams.train_docs, stdlib_streams.val_docs) == (len(train_files),
                                                                   len(val_files))
    # The validation stream is exactly its documents, in order; train holds the remaining bytes.
    expected_val = [t for f in val_files
                    for t in byte_doc(f.path.read_bytes().decode("utf-8", errors="replace"))]
    assert stdlib_streams.val_N.tolist() == expected_val
    assert int((stdlib_streams.train_N == EOS).sum()) == len(train_files)


# ---------------------------------------------------------------------------------------------
# File formats
# ---------------------------------------------------------------------------------------------


def test_txt_directory(tmp_path):
    texts = {"c.txt": "third", "a.txt": "first ü", "b/x.txt": "second\n", "notes.md": "ignored"}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    streams = streams_of(tmp_path, val_fraction=0.0)
    expected = byte_doc("first ü") + byte_doc("second\n") + byte_doc("third")
    assert streams.train_N.tolist() == expected
    assert streams.val_N.size == 0 and streams.train_docs == 3


def test_txt_file_is_one_document_as_the_help_says(tmp_path):
    text = "first paragraph\n\nsecond paragraph\n"
    _write(tmp_path / "a.txt", text)
    assert streams_of(tmp_path / "a.txt", val_fraction=0.0).train_N.tolist() == byte_doc(text)
    assert "A .txt file is one document" in field_docs()["data.path"]


def test_directory_follows_symlinked_directories(tmp_path):
    outside = _write(tmp_path / "outside" / "b.txt", "linked").parent
    _write(outside / "deep" / "c.txt", "deeper")
    (outside / "deep" / "loop").symlink_to(outside, target_is_directory=True)
    data = _write(tmp_path / "data" / "a.txt", "plain").parent
    (data / "linked").symlink_to(outside, target_is_directory=True)
    (data / "self").symlink_to(data, target_is_directory=True)  # loops are walked once
    names = [f.name for f in find_data_files(str(data))]
    assert names == ["a.txt", "linked/b.txt", "linked/deep/c.txt"]  # relative to data.path
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == byte_doc("plain") + byte_doc("linked") + byte_doc("deeper")


def test_jsonl(tmp_path):
    lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": ""}),
             json.dumps({"body": "zwei ß"}), json.dumps({"text": "three"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    assert streams_of(tmp_path / "d.jsonl", val_fraction=0.0).train_N.tolist() == (
        byte_doc("one") + byte_doc("three"))
    (tmp_path / "e.jsonl").write_text(lines[3])
    streams = streams_of(tmp_path / "e.jsonl", val_fraction=0.0, text_field="body")
    assert streams.train_N.tolist() == byte_doc("zwei ß")


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_jsonl_replaces_undecodable_text_and_skips_nulls(tmp_path, tokenizer):
    # As .txt does: bad UTF-8 bytes and lone surrogate escapes become U+FFFD; a null text is no
    # document, as in .parquet. The file starts with a UTF-8 byte-order mark.
    lines = [b'\xef\xbb\xbf{"text": "hello \\ud800 world"}', b'{"text": null}',
             b'{"text": "hello \xff"}',
             b'{"text": "\\ud83d\\ude00 world"}']  # a valid pair: one emoji
    _write(tmp_path / "d.jsonl", b"\n".join(lines))
    if tokenizer == "bytes":
        expected = (byte_doc("hello \ufffd world") + byte_doc("hello \ufffd")
                    + byte_doc("\U0001F600 world"))
        assert streams_of(tmp_path / "d.jsonl", val_fraction=0.0).train_N.tolist() == expected
    else:
        hf = HFTokenizer(str(write_hf_tokenizer(tmp_path / "tokenizer.json")))
        streams = streams_of(tmp_path / "d.jsonl", hf, val_fraction=0.0)
        assert streams.train_N.tolist() == [1, 0, 2, 3, 1, 0, 3, 0, 2, 3]  # 0: [UNK]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"content": ["alpha", None, "", "βeta"], "n": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    streams = streams_of(tmp_path / "d.parquet", val_fraction=0.0, text_field="content")
    assert streams.train_N.tolist() == byte_doc("alpha") + byte_doc("βeta")


def test_text_with_hf_tokenizer(tmp_path):
    tokenizer = HFTokenizer(str(write_hf_tokenizer(tmp_path / "tokenizer.json")))
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "world"}\n')
    streams = streams_of(tmp_path / "d.jsonl", tokenizer, val_fraction=0.0)
    assert streams.train_N.tolist() == [1, 2, 3, 2, 3] and streams.eos_id == 3


def test_text_with_a_protocol_only_tokenizer(tmp_path):
    class CharTokenizer:  # no encode_batch_np: exercises the plain `encode` path
        name, vocab_size, eos_id = "chars", 120_000, 119_999

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    (tmp_path / "a.txt").write_text("hi 𝄞")
    streams = streams_of(tmp_path, CharTokenizer(), val_fraction=0.0)
    assert streams.train_N.dtype == np.uint32
    assert streams.train_N.tolist() == [ord("h"), ord("i"), ord(" "), ord("𝄞"), 119_999]


def test_text_split_follows_document_name_hash(tmp_path):
    docs = [f"document number {i}" for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    streams = streams_of(tmp_path, val_fraction=0.1)
    is_val = [zlib.crc32(f"d.jsonl:{i + 1}".encode()) % 10_000 < 1000 for i in range(300)]
    assert streams.val_N.tolist() == [t for d, v in zip(docs, is_val) if v for t in byte_doc(d)]
    assert streams.train_N.tolist() == [t for d, v in zip(docs, is_val) if not v
                                        for t in byte_doc(d)]
    assert 10 < streams.val_docs < 60


def test_text_split_keeps_both_sides_nonempty(tmp_path):
    for name in ("a.txt", "b.txt"):
        assert zlib.crc32(name.encode()) % 10_000 >= 1  # precondition: hash holds out neither
        (tmp_path / name).write_text(name)
    streams = streams_of(tmp_path, val_fraction=0.0001)
    assert streams.train_N.tolist() == byte_doc("a.txt")
    assert streams.val_N.tolist() == byte_doc("b.txt")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin(tmp_path, dtype):
    tokens_N = np.array([5, 70_000 if dtype == "uint32" else 7, 9, 11, 13], dtype=dtype)
    tokens_N.tofile(tmp_path / "t.bin")
    cfg = DataConfig(path=str(tmp_path / "t.bin"), token_dtype=dtype, val_fraction=0.4, eos_id=9)
    streams = build_token_streams(cfg, BYTES, vocab_size=100_000)
    assert streams.train_N.tolist() == tokens_N[:3].tolist()
    assert streams.val_N.tolist() == tokens_N[3:].tolist()
    assert streams.eos_id == 9 and streams.train_docs is None


def test_npy_and_multiple_token_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(0, 60, dtype=np.int64))
    np.arange(60, 100, dtype=np.uint16).tofile(tmp_path / "b.bin")
    streams = streams_of(tmp_path, val_fraction=0.25)
    assert streams.train_N.tolist() == list(range(75))
    assert streams.val_N.tolist() == list(range(75, 100))
    assert streams.eos_id == EOS
    single = streams_of(tmp_path / "a.npy", val_fraction=0.0)
    # Read in place, not copied: a view of the file's ids, read with pread (token_files.py)
    assert isinstance(single.train_N, ConcatenatedTokens) and single.train_N.tolist() == list(range(60))


# ---------------------------------------------------------------------------------------------
# Bad input: one-line DataErrors naming the option
# ---------------------------------------------------------------------------------------------


def _write(path: Path, content: bytes | str | np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, np.ndarray):
        np.save(path, content)
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def _empty_dir(directory: Path) -> Path:
    directory.mkdir()
    return directory


def _mixed_dir(directory: Path) -> Path:
    _write(directory / "a.npy", np.ones(3, np.int64))
    _write(directory / "b.txt", "text")
    return directory


BAD_INPUTS = {
    "missing": (lambda d: d / "nope", "no such file or directory"),
    "empty dir": (_empty_dir, "no .txt, .jsonl, .parquet, .npy or .bin files found"),
    "only unsupported": (lambda d: _write(d / "x.csv", "a,b").parent,
                         "no .txt, .jsonl, .parquet, .npy or .bin files found"),
    "unsupported suffix": (lambda d: _write(d / "x.csv", "a,b"), "unsupported file type .csv"),
    "empty file": (lambda d: _write(d / "x.txt", ""), "empty file"),
    "bad json": (lambda d: _write(d / "x.jsonl", '{"text": "a"}\n{oops\n'),
                 "line 2: not valid JSON"),
    "missing field": (lambda d: _write(d / "x.jsonl", '{"txt": "a"}\n'), "line 1: no field 'text'"),
    "non-string field": (lambda d: _write(d / "x.jsonl", '{"text": 3}\n'), "not a string"),
    "zero documents": (lambda d: _write(d / "x.jsonl", '{"text": ""}\n\n'), "no documents"),
    "corrupt parquet": (lambda d: _write(d / "x.parquet", "PAR1garbage"), "not a valid Parquet"),
    "odd bin size": (lambda d: _write(d / "x.bin", b"\x01\x02\x03"), "data.token_dtype"),
    "2-d npy": (lambda d: _write(d / "x.npy", np.zeros((2, 2), np.int32)), "1-D integer"),
    "float npy": (lambda d: _write(d / "x.npy", np.zeros(4, np.float32)), "1-D integer"),
    "corrupt npy": (lambda d: _write(d / "x.npy", b"not numpy"), "not a .npy file"),
    "truncated npy": (lambda d: _write(d / "x.npy", b"\x93NUMPY\x01\x00"), "not a valid .npy"),
    "ids beyond vocab": (lambda d: _write(d / "x.npy", np.array([1, 300])), "data.tokenizer"),
    "mixed kinds": (_mixed_dir, "mixes text files"),
    "single document too short": (lambda d: _write(d / "x.txt", "only one"),
                                  "one document of 9 tokens cannot be split"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_data_path(tmp_path, case):
    make_path, expected = BAD_INPUTS[case]
    path = make_path(tmp_path / "data")
    with pytest.raises(DataError) as info:
        streams_of(path)
    message = str(info.value)
    assert message.startswith(f"data.path={path}") and expected in message, message
    assert "\n" not in message


def test_a_single_text_file_holds_out_its_last_tokens(tmp_path):
    """One .txt file (nanoGPT's input.txt) is one document: validation takes its last
    val_fraction of tokens, as a token file's, instead of refusing the default split."""
    text = "".join(chr(ord("a") + i % 26) for i in range(999))
    streams = streams_of(_write(tmp_path / "input.txt", text), val_fraction=0.1)
    ids_N = np.array(list(text.encode()) + [EOS])
    assert streams.train_N.tolist() == ids_N[:900].tolist()
    assert streams.val_N.tolist() == ids_N[900:].tolist()


def test_error_in_a_directory_names_the_file(tmp_path):
    _write(tmp_path / "sub" / "x.jsonl", '{"text": "a"}\n\n{"text": 1.5}\n')
    with pytest.raises(DataError) as info:
        streams_of(tmp_path)
    assert str(info.value).startswith(f"data.path={tmp_path}: sub/x.jsonl: line 3: ")


def test_bad_eos_id(tmp_path):
    path = _write(tmp_path / "x.npy", np.arange(10))
    with pytest.raises(DataError, match=r"^data\.eos_id=300 "):
        streams_of(path, eos_id=300)


def test_eos_id_refused_for_text(tmp_path):
    # Text documents end with the tokenizer's EOS; data.eos_id would silently do nothing.
    path = _write(tmp_path / "x.txt", "some text")
    with pytest.raises(DataError, match=r"^data\.eos_id=5: .*token files .*data\.path=") as info:
        streams_of(path, eos_id=5)
    assert "\n" not in str(info.value)


def test_ids_beyond_vocab_after_the_startup_check_fail_the_batch(tmp_path, monkeypatch):
    # The startup check reads each token file's head only; the loaders check every batch.
    monkeypatch.setattr(corpus, "_VOCAB_CHECK_TOKENS", 8)
    tokens_N = np.arange(64) % 200
    tokens_N[40], tokens_N[60] = 300, 999  # beyond the byte vocabulary (257), after the head
    path = _write(tmp_path / "x.npy", tokens_N)
    streams = streams_of(path, val_fraction=0.25)  # validation: tokens 48..63
    assert streams.vocab.size == EOS + 1
    train = TrainLoader(PackedSequences(streams.train_N, 7), 6, 0, EOS, vocab=streams.vocab)
    with pytest.raises(DataError) as info:
        train.next_batch()  # 6 of the 6 sequences: holds token 40
    assert str(info.value) == (f"data.path={path}: token id 300 in a training batch is outside "
                               f"the vocabulary [0, 257) of tokenizer bytes; set data.tokenizer "
                               "to the tokenizer that produced the data")
    with pytest.raises(DataError, match=r"^data\.path=.*: token id 999 in a validation batch "):
        val_batches(PackedSequences(streams.val_N, 7), 2, 1, EOS, vocab=streams.vocab)
    below = Vocabulary(size=10, tokenizer="t.json", data_path="d")
    with pytest.raises(DataError, match=r"^data\.path=d: token id -1 in a training batch "):
        TrainLoader(PackedSequences(np.arange(-1, 8), 4), 2, 0, EOS, vocab=below).next_batch()
    unchecked = TrainLoader(PackedSequences(streams.train_N, 7), 6, 0, EOS)  # vocab=None
    assert unchecked.next_batch().input_ids_BS.max() == 300


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, seq_len", [(23, 5), (21, 5), (6, 5), (100, 1)])
def test_packed_sequences_windows(num_tokens, seq_len):
    tokens_N = np.arange(num_tokens, dtype=np.uint16)
    sequences = PackedSequences(tokens_N, seq_len)
    expected = [list(range(i * seq_len, i * seq_len + seq_len + 1))
                for i in range(num_tokens) if i * seq_len + seq_len + 1 <= num_tokens]
    assert len(sequences) == len(expected) == (num_tokens - 1) // seq_len
    for i, window in enumerate(expected):
        assert sequences[i].dtype == torch.int64 and sequences[i].tolist() == window


def test_packed_sequences_too_short():
    with pytest.raises(DataError, match=r"^train\.seq_len=8: .* 8 tokens"):
        PackedSequences(np.arange(8), 8)


def test_batch_labels_and_doc_ids_match_naive_reference():
    generator = np.random.default_rng(0)
    tokens_N = generator.integers(0, 4, size=4 * 33 + 1)  # id 3 plays EOS: frequent documents
    sequences = PackedSequences(tokens_N, 33)
    batch = make_batch(sequences.gather(range(4)), eos_id=3)
    assert batch.input_ids_BS.shape == batch.labels_BS.shape == batch.doc_ids_BS.shape == (4, 33)
    assert batch.doc_ids_BS.dtype == torch.int32 and batch.num_tokens == 4 * 33
    assert torch.equal(batch.to("cpu").labels_BS, batch.labels_BS)
    for b in range(4):
        window = tokens_N[b * 33:b * 33 + 34].tolist()
        assert batch.input_ids_BS[b].tolist() == window[:-1]
        assert batch.labels_BS[b].tolist() == window[1:]
        doc_ids, doc = [], 0
        for token in window[:-1]:
            doc_ids.append(doc)
            doc += token == 3
        assert batch.doc_ids_BS[b].tolist() == doc_ids


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def make_loader(num_sequences=10, batch_size=3, seed=0) -> TrainLoader:
    # With seq_len 4 and an arange stream, a sequence's first token / 4 is its index.
    sequences = PackedSequences(np.arange(num_sequences * 4 + 1), 4)
    return TrainLoader(sequences, batch_size, seed, eos_id=-1)


def sequence_ids(batch: Batch) -> list[int]:
    return (batch.input_ids_BS[:, 0] // 4).tolist()


def test_train_loader_order_is_seeded_permutation_per_epoch():
    loader = make_loader(num_sequences=10, batch_size=3, seed=7)
    for epoch in range(3):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 1_000_003 + epoch))
        visited = [i for _ in range(3) for i in sequence_ids(next(loader))]
        assert visited == order[:9].tolist()  # the partial 4th batch is dropped
        assert len(set(visited)) == 9


def test_train_loader_seeds():
    first = [sequence_ids(b) for b, _ in zip(make_loader(seed=1), range(6))]
    again = [sequence_ids(b) for b, _ in zip(make_loader(seed=1), range(6))]
    other = [sequence_ids(b) for b, _ in zip(make_loader(seed=2), range(6))]
    assert first == again and first != other


@pytest.mark.parametrize("resume_after", [0, 2, 3, 4, 7])  # 3 batches per epoch
def test_train_loader_resumes_identically(resume_after):
    original = make_loader(seed=5)
    for _ in range(resume_after):
        original.next_batch()
    resumed = make_loader(seed=5)
    resumed.load_state_dict(original.state_dict())
    for _ in range(5):  # crosses at least one epoch boundary
        a, b = original.next_batch(), resumed.next_batch()
        assert torch.equal(a.input_ids_BS, b.input_ids_BS)
        assert torch.equal(a.labels_BS, b.labels_BS) and torch.equal(a.doc_ids_BS, b.doc_ids_BS)


def test_train_loader_errors():
    with pytest.raises(DataError, match=r"^train\.micro_batch_size · data-parallel ranks = 11 "
                                        r"sequences exceeds the 10 "):
        make_loader(num_sequences=10, batch_size=11)
    with pytest.raises(DataError, match="data loader state"):
        make_loader().load_state_dict({"epoch": 0, "cursor": 11})


@pytest.mark.parametrize("num_sequences, batch_size, num_batches, expected", [
    (10, 3, 2, [[0, 1, 2], [3, 4, 5]]),
    (10, 4, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (2, 4, 8, [[0, 1]]),
])
def test_val_batches(num_sequences, batch_size, num_batches, expected):
    sequences = PackedSequences(np.arange(num_sequences * 4 + 1), 4)
    batches = val_batches(sequences, batch_size, num_batches, eos_id=-1)
    assert [sequence_ids(b) for b in batches] == expected
