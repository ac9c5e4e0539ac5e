"""A long text is encoded in pieces (data/tokenizer.py `_encode_long`) only where that gives the
ids of one call: compared with one `tokenizers` call for GPT-2's, Llama 3's and SentencePiece's
pre-tokenizers."""

from __future__ import annotations

import argparse
import email.message
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from moefold.data import HFTokenizer, tokenizer as tokenizer_module  # noqa: E402

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "llama3": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    # Prepends "▁" to each call's text: pieces would differ at every cut.
    "sentencepiece": lambda: pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
}


def text() -> str:
    """Source code and prose: lines that start with a word, with spaces, blank lines."""
    sources = [Path(module.__file__).read_text() for module in (argparse, json, email.message)]
    return "\n\n".join(sources) + "\n  indented last line\n\n"


def trained(kind: str, path: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[kind]()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text()], trainer)
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("kind, pieced", [("gpt2", True), ("llama3", True),
                                          ("sentencepiece", False)])
def test_long_texts_encode_as_one_call(kind, pieced, tmp_path, monkeypatch):
    path = trained(kind, tmp_path / "tokenizer.json")
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 3000)
    monkeypatch.setattr(tokenizer_module, "PIECES_PER_CALL", 3)
    tokenizer = HFTokenizer(str(path))
    texts = [text(), "a short document", text()[5000:60000]]
    reference = Tokenizer.from_file(str(path))
    reference.encode_special_tokens = True
    for ids_N, one_text in zip(tokenizer.encode_batch_np(texts), texts, strict=True):
        np.testing.assert_array_equal(ids_N, reference.encode(one_text, add_special_tokens=False).ids)

    cuts = tokenizer_module._line_cuts(texts[0], 3000)
    assert len(cuts) > 10 and all(texts[0][cut - 1] == "\n" and not texts[0][cut].isspace()
                                  for cut in cuts)
    assert all(tokenizer._splits_at(texts[0], cut) for cut in cuts) is pieced


def test_a_text_without_line_starts_is_one_piece():
    assert tokenizer_module._line_cuts("x" * 10_000, 100) == []
    assert tokenizer_module._line_cuts(("x" * 150 + "\n ") * 10, 100) == []
    assert tokenizer_module._line_cuts(("x" * 150 + "\n") * 4, 100) == [151, 302, 453]
