"""A long text is encoded in pieces (data/tokenizer.py `_encode_long`) only where that gives the
ids of one call: compared with one `tokenizers` call for GPT-2's, Llama 3's and SentencePiece's
pre-tokenizers, and for the forms SentencePiece's "▁" dummy prefix takes in a tokenizer.json."""

from __future__ import annotations

import argparse
import email.message
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizers import (  # noqa: E402
    Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers)

from moefold.data import HFTokenizer, tokenizer as tokenizer_module  # noqa: E402

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "llama3": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    # Prepends "▁" to each call's text: plain pieces would differ at every cut.
    "sentencepiece": lambda: pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
}
# Lines that start with a non-ASCII character (cuts land before some), with spaces, a literal "▁".
UNICODE_LINES = ("Zürich — naïve café 東京 🙂\n東京の天気は晴れ\n\n  ε ≤ δ indented\n"
                 "\u2581 a literal metaspace\nÜber 🙂 emoji first\n")


def text() -> str:
    """Source code, prose and unicode: lines that start with a word, with spaces, blank lines."""
    sources = [Path(module.__file__).read_text() for module in (argparse, json, email.message)]
    return (UNICODE_LINES * 3).join(sources) + "\n  indented last line\n\n"


def trained(kind: str, path: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[kind]()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text()], trainer)
    tokenizer.save(str(path))
    return path


def sentencepiece(form: str, path: Path) -> Path:
    """A tokenizer that prepends "▁" to each call's text as Hugging Face converts SentencePiece's:
    a Metaspace pre-tokenizer ("first" or "always"; "first" without splitting at spaces, as
    transformers' Llama converter writes it), or, in Llama 2's, Mistral's and Mixtral's
    tokenizer.json, a Prepend normalizer and no pre-tokenizer. "unigram" is T5's model."""
    model, trainer = models.BPE(), trainers.BpeTrainer
    if form == "unigram":
        model, trainer = models.Unigram(), trainers.UnigramTrainer
    tokenizer = Tokenizer(model)
    scheme = "always" if form == "always" else "first"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=scheme)
    tokenizer.train_from_iterator([text()], trainer(vocab_size=600, special_tokens=["</s>"]))
    if form == "no-split":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    if form == "prepend":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                     normalizers.Replace(" ", "\u2581")])
        tokenizer.pre_tokenizer = None
    tokenizer.save(str(path))
    return path


class CountingTokenizer:
    """A `tokenizers.Tokenizer` that records the length of each text it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def encode_batch(self, texts, **kwargs):
        self.lengths += [len(text) for text in texts]
        return self.tokenizer.encode_batch(texts, **kwargs)


def one_call(path: Path, text: str) -> list[int]:
    reference = Tokenizer.from_file(str(path))
    reference.encode_special_tokens = True
    return reference.encode(text, add_special_tokens=False).ids


def counted(path: Path) -> HFTokenizer:
    tokenizer = HFTokenizer(str(path))
    tokenizer._tokenizer = CountingTokenizer(tokenizer._tokenizer)
    return tokenizer


@pytest.mark.parametrize("kind, lead", [("gpt2", ""), ("llama3", ""), ("sentencepiece", "\n")])
def test_long_texts_encode_as_one_call(kind, lead, tmp_path, monkeypatch):
    path = trained(kind, tmp_path / "tokenizer.json")
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 3000)
    monkeypatch.setattr(tokenizer_module, "PIECES_PER_CALL", 3)
    tokenizer = HFTokenizer(str(path))
    texts = [text(), "a short document", text()[5000:60000]]
    for ids_N, one_text in zip(tokenizer.encode_batch_np(texts), texts, strict=True):
        np.testing.assert_array_equal(ids_N, one_call(path, one_text))

    cuts = tokenizer_module._line_cuts(texts[0], 3000)
    assert len(cuts) > 10 and all(texts[0][cut - 1] == "\n" and not texts[0][cut].isspace()
                                  for cut in cuts)
    leads = [lead for lead in tokenizer_module.LEADS
             if all(tokenizer._splits_at(texts[0], cut, lead) for cut in cuts)]
    assert leads[0] == lead


@pytest.mark.parametrize("form", ["first", "always", "no-split", "prepend", "unigram"])
def test_sentencepiece_texts_encode_in_pieces(form, tmp_path, monkeypatch):
    path = sentencepiece(form, tmp_path / "tokenizer.json")
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 200)
    monkeypatch.setattr(tokenizer_module, "PIECES_PER_CALL", 3)
    tokenizer, long_text = counted(path), text()
    assert one_call(path, "\nx")[:2] == one_call(path, "\n")  # "▁" goes before a call's text
    assert one_call(path, "x")[0] != one_call(path, "\nx")[2]

    np.testing.assert_array_equal(tokenizer.encode_batch_np([long_text])[0],
                                  one_call(path, long_text))
    # Pieces, not one call (a piece runs on to a line that starts unindented: up to 38k characters).
    assert max(tokenizer._tokenizer.lengths) < len(long_text) / 3
    cuts = tokenizer_module._line_cuts(long_text, 200)
    assert len(cuts) > 50
    assert any(not long_text[cut].isascii() for cut in cuts)
    assert any(long_text[cut - 2:cut] == "\n\n" for cut in cuts)


def test_a_token_across_a_cut_keeps_one_call(tmp_path, monkeypatch):
    """"\nd" as one token spans each cut before a line that starts with "d" (def, del): no lead
    gives one call's ids there, so the whole text is one call."""
    tokenizer = Tokenizer.from_file(str(sentencepiece("first", tmp_path / "spm.json")))
    tokenizer.add_tokens(["\nd"])
    tokenizer.save(str(path := tmp_path / "tokenizer.json"))
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 200)
    tokenizer, long_text = counted(path), text()
    assert any(long_text[cut] == "d" for cut in tokenizer_module._line_cuts(long_text, 200))

    np.testing.assert_array_equal(tokenizer.encode_batch_np([long_text])[0],
                                  one_call(path, long_text))
    assert max(tokenizer._tokenizer.lengths) == len(long_text)


def test_a_text_without_line_starts_is_one_piece():
    assert tokenizer_module._line_cuts("x" * 10_000, 100) == []
    assert tokenizer_module._line_cuts(("x" * 150 + "\n ") * 10, 100) == []
    assert tokenizer_module._line_cuts(("x" * 150 + "\n") * 4, 100) == [151, 302, 453]
