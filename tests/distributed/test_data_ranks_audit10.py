"""A text corpus tokenized once over a run's ranks (data/corpus.py's `_encode_shared`), on 2 and 3
gloo ranks: every rank ends with the streams one process builds (the reference: build_token_streams
with no group), byte for byte, with its split, document counts and fingerprint; the ranks encode
each document once between them; a bad document or file stops every rank with the line one process
says. Small batches (`_ENCODE_BATCH`) spread a small corpus over many batches, hence over the ranks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from conftest import write_text_corpus
from ranks import run_ranks

from moefold.config import DataConfig
from moefold.data import corpus
from moefold.data.corpus import build_token_streams, stream_fingerprint
from moefold.data.tokenizer import ByteTokenizer
from moefold.errors import DataError


class CountingBytes(ByteTokenizer):
    """The byte tokenizer, counting the documents it encodes; `vocab_size` below 256 makes it
    refuse (as ids outside its vocabulary) the bytes at and past it."""

    def __init__(self, vocab_size: int = 257):
        self.vocab_size, self.eos_id = vocab_size, vocab_size - 1
        self.encoded = 0

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        self.encoded += len(texts)
        return super().encode_batch_np(texts)


def _summary(build) -> dict:
    """What a rank's (or the reference's) streams are, or the DataError it raised."""
    try:
        streams = build()
    except DataError as e:
        return {"error": str(e)}
    return {"train": hashlib.sha256(streams.train_N.tobytes()).hexdigest(),
            "val": hashlib.sha256(streams.val_N.tobytes()).hexdigest(),
            "sizes": [len(streams.train_N), len(streams.val_N)], "dtype": str(streams.train_N.dtype),
            "docs": [streams.train_docs, streams.val_docs], "eos": streams.eos_id, "source": streams.source,
            "fingerprint": stream_fingerprint(streams.train_N)}


def _build(data_cfg: DataConfig, tokenizer: CountingBytes, encode_batch: int, group=None):
    corpus._ENCODE_BATCH = encode_batch
    return lambda: build_token_streams(data_cfg, tokenizer, group=group)


def _on_rank(rank: int, data_cfg: DataConfig, vocab_size: int, encode_batch: int, out: Path) -> None:
    dist.init_process_group("gloo")
    tokenizer = CountingBytes(vocab_size)
    summary = _summary(_build(data_cfg, tokenizer, encode_batch, dist.new_group(backend="gloo")))
    (out / f"rank{rank}.json").write_text(json.dumps({**summary, "encoded": tokenizer.encoded}))


def _ranks_and_reference(tmp_path: Path, world: int, data_cfg: DataConfig, vocab_size: int = 257,
                         encode_batch: int = 3) -> tuple[list[dict], dict]:
    """Each rank's summary (with the documents it encoded) and one process's (with its count)."""
    run_ranks(world, _on_rank, data_cfg, vocab_size, encode_batch, tmp_path)
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    saved_batch = corpus._ENCODE_BATCH
    try:
        tokenizer = CountingBytes(vocab_size)
        reference = {**_summary(_build(data_cfg, tokenizer, encode_batch)), "encoded": tokenizer.encoded}
    finally:
        corpus._ENCODE_BATCH = saved_batch
    return said, reference


def _few_documents(root: Path, texts: Sequence[str]) -> Path:
    root.mkdir()
    for i, text in enumerate(texts):
        (root / f"doc{i:02d}.txt").write_text(text)
    return root


def _without_count(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key != "encoded"}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["both sides", "no validation", "validation left empty",
                                  "train left empty", "one document", "the stdlib"])
def test_every_rank_holds_the_streams_of_one_process_each_document_encoded_once(tmp_path, world, case):
    corpus_dir = tmp_path / "corpus"
    data_cfg, encode_batch = DataConfig(path=str(write_text_corpus(corpus_dir))), 3
    if case == "no validation":
        data_cfg.val_fraction = 0.0
    elif case in ("validation left empty", "train left empty"):  # one document moves across
        few = _few_documents(tmp_path / "few", [f"text {i} " * (i + 5) for i in range(5)])
        data_cfg = DataConfig(path=str(few), val_fraction=0.0001 if case == "validation left empty" else 0.9999)
        encode_batch = 1
    elif case == "one document":
        data_cfg = DataConfig(path=str(corpus_dir / "doc07.txt"), val_fraction=0.1)
    elif case == "the stdlib":
        data_cfg, encode_batch = DataConfig(), corpus._ENCODE_BATCH
    said, reference = _ranks_and_reference(tmp_path, world, data_cfg, encode_batch=encode_batch)
    assert "error" not in reference, reference
    if case in ("validation left empty", "train left empty"):
        assert reference["docs"] == ([4, 1] if case == "validation left empty" else [1, 4])
    assert [_without_count(s) for s in said] == [_without_count(reference)] * world
    assert sum(s["encoded"] for s in said) == reference["encoded"]  # each document once over the ranks


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["two refused documents", "a refused document, then a bad file",
                                  "a bad file, then a refused document"])
def test_every_rank_raises_what_one_process_meets_first(tmp_path, world, case):
    """Batches of one document: some hold a byte the tokenizer of 200 ids refuses, or a file is
    UTF-16, refused as it is read: met on different ranks, the first in the corpus' order is the
    line every rank says."""
    refused, utf16 = {"two refused documents": ((5, 8), None),
                      "a refused document, then a bad file": ((5,), 7),
                      "a bad file, then a refused document": ((7,), 2)}[case]
    texts = ["plain text " * 4] * 10
    for i in refused:
        texts[i] = "price: 5 \u20ac"  # UTF-8 E2 82 AC: id 226, outside [0, 200)
    root = _few_documents(tmp_path / "docs", texts)
    if utf16 is not None:
        (root / f"doc{utf16:02d}.txt").write_bytes("\ufeffplain".encode("utf-16"))
    said, reference = _ranks_and_reference(tmp_path, world, DataConfig(path=str(root), val_fraction=0.0),
                                           vocab_size=200, encode_batch=1)
    first = f"doc{min([*refused, utf16 if utf16 is not None else 99]):02d}.txt"
    assert first in reference["error"], reference
    assert [s["error"] for s in said] == [reference["error"]] * world


def _trainer_on_rank(rank: int, corpus_dir: Path, out: Path) -> None:
    from conftest import TINY_OVERRIDES

    from moefold.config import load_config
    from moefold.train import trainer as trainer_module

    tokenizer = CountingBytes()
    trainer_module.build_tokenizer = lambda name: tokenizer  # this process's trainer encodes with it
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus_dir), "parallel.ep": "2"})
    trainer = trainer_module.Trainer(cfg, out / f"run{rank}", out=lambda line: None)
    (out / f"rank{rank}.json").write_text(json.dumps({"encoded": tokenizer.encoded,
                                                      "fingerprint": trainer._data_fingerprint}))


def test_a_trainer_on_two_ranks_encodes_each_document_once_between_them(tmp_path):
    corpus_dir = write_text_corpus(tmp_path / "corpus")
    run_ranks(2, _trainer_on_rank, corpus_dir, tmp_path)
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    one_process = build_token_streams(DataConfig(path=str(corpus_dir)), ByteTokenizer())
    assert sum(s["encoded"] for s in said) == len(list(corpus_dir.iterdir()))
    assert [s["fingerprint"] for s in said] == [stream_fingerprint(one_process.train_N)] * 2
