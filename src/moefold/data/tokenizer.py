"""Tokenizers: a dependency-free byte-level one and a wrapper around a Hugging Face tokenizer.json.

Both expose the small `Tokenizer` protocol the rest of moefold uses, plus `encode_batch_np`, the
fast path the corpus builder calls (one NumPy array per document, no Python lists of ints).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from moefold.errors import ConfigError, DataError

# DeepSeek-V2/V3's <｜end▁of▁sentence｜>, escaped: fullwidth bars (U+FF5C), "▁" (U+2581) for spaces.
DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
# The first of these present in the vocabulary is the end-of-document token, in this order; then
# the eos_token of a tokenizer_config.json beside the tokenizer.json (after, not before: a Qwen
# instruct config names <|im_end|>, which ends a chat turn, not a document).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>",
                  DEEPSEEK_EOS)

# Texts longer than PIECE_CHARS characters are encoded PIECES_PER_CALL pieces at a time (~100 MB
# of the tokenizer's memory a call); a cut is checked on SEAM_CHARS characters either side.
PIECE_CHARS = 1 << 18
PIECES_PER_CALL = 4
SEAM_CHARS = 256
# Text encoded before each later piece and its ids dropped, in the order tried: none, then the
# newline before the cut (every cut follows one). A SentencePiece-style tokenizer prepends "▁" to
# each call's text (its dummy prefix, from a Metaspace pre-tokenizer or a Prepend normalizer):
# alone, a piece's first word would take it; after the newline, the "▁" goes on the dropped ids.
LEADS = ("", "\n")


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (no EOS)."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt to continue, as transformers' `tokenizer(text)["input_ids"]`."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are dropped."""
        ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes, 256 is end-of-document. Lossless on any text."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        """`encode`: the bytes have no special tokens to add."""
        return self.encode(text)

    def encode_np(self, text: str) -> np.ndarray:
        """`encode` as a uint8 array, without a Python int per byte (~1 GB/s)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_np(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids_N = np.asarray(_id_list(ids), dtype=np.int64)
        bytes_N = ids_N[(ids_N >= 0) & (ids_N < 256)].astype(np.uint8)
        return bytes_N.tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str):
        self.name = path
        self._tokenizer = _load_tokenizer_json(path)
        # Text that spells a special token ("<|endoftext|>" in a document) stays plain text:
        # only the corpus builder may insert EOS.
        self._tokenizer.encode_special_tokens = True
        # A tokenizer.json may be saved with truncation or padding on (after a call that used
        # them): documents would be cut to max_length and padded, silently. transformers too turns
        # both off for a call that does not ask for them.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.vocab_size: int = _id_bound(self._tokenizer)
        self.eos_id: int = _find_eos_id(self._tokenizer, path)

    def encode(self, text: str) -> list[int]:
        with self._refusals():
            return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """As transformers' `tokenizer(text)["input_ids"]` of the same tokenizer.json: the special
        tokens its post-processor adds (Llama's, Mixtral's and DeepSeek's BOS; Qwen's none:
        transformers 5 takes it over tokenizer_config.json's add_bos_token), and a special token
        spelled in the text (a chat template's <|im_start|>) read as that token. Documents are
        encoded by `encode`, without either: a prompt differs from training text only here.
        Thread-safe, as `encode` is: it reads its own copy of the tokenizer (`_prompt_tokenizer`)."""
        with self._refusals():
            return self._prompt_tokenizer.encode(text, add_special_tokens=True).ids

    @functools.cached_property
    def _prompt_tokenizer(self):
        """A copy of the tokenizer that reads a special token spelled in the text as that token.
        Switching the shared one's encode_special_tokens for a prompt's call changed how any
        encode running meanwhile in another thread read such text (a document's, or another
        prompt's). Made at the first prompt: a training never needs it."""
        prompt_tokenizer = type(self._tokenizer).from_str(self._tokenizer.to_str())
        prompt_tokenizer.encode_special_tokens = False
        prompt_tokenizer.no_truncation()  # as __init__ sets the shared one (to_str keeps them anyway)
        prompt_tokenizer.no_padding()
        return prompt_tokenizer

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        with self._refusals():
            return self._encode_batch_np(texts)

    @contextlib.contextmanager
    def _refusals(self) -> Iterator[None]:
        """Text this tokenizer cannot encode is a one-line DataError: tokenizers raises a bare
        Exception ("WordLevel error: Missing [UNK] token from the vocabulary" for a word a model
        without an unknown token lacks). The corpus names the document."""
        try:
            yield
        except (DataError, MemoryError):
            raise
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"tokenizer {self.name} cannot encode the text ({reason})") from None

    def _encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch runs on all cores in Rust; worth it for corpora of many small documents.
        ids = [None if len(text) > PIECE_CHARS else text for text in texts]
        short = [i for i, text in enumerate(ids) if text is not None]
        encodings = self._tokenizer.encode_batch([texts[i] for i in short], add_special_tokens=False)
        for i, encoding in zip(short, encodings):
            ids[i] = np.asarray(encoding.ids, dtype=np.int64)
        return [self._encode_long(text) if ids_N is None else ids_N
                for text, ids_N in zip(texts, ids)]

    def _encode_long(self, text: str) -> np.ndarray:
        """A long text (a whole .txt file) encoded in line-aligned pieces, a few at a time: in one
        call the Rust tokenizer holds ~150 bytes per character (20 MB of text took 3.4 GB) and
        runs on one core. Only cuts where this tokenizer splits anyway are taken, each piece
        after the first led by the first of `LEADS` that gives one call's ids at every cut; where
        none does, one call."""
        cuts = _line_cuts(text, PIECE_CHARS)
        lead = next((lead for lead in LEADS
                     if all(self._splits_at(text, cut, lead) for cut in cuts)), None)
        if lead is None:
            cuts, lead = [], ""
        starts = [0, *(cut - len(lead) for cut in cuts)]
        pieces = [text[start:end] for start, end in zip(starts, [*cuts, len(text)])]
        drops = [0] + [len(self.encode(lead))] * len(cuts)
        ids: list[np.ndarray] = []
        for first in range(0, len(pieces), PIECES_PER_CALL):
            encodings = self._tokenizer.encode_batch(pieces[first:first + PIECES_PER_CALL],
                                                     add_special_tokens=False)
            ids += [np.asarray(encoding.ids[drop:], dtype=np.int64)
                    for encoding, drop in zip(encodings, drops[first:])]
        return np.concatenate(ids)

    def _splits_at(self, text: str, cut: int, lead: str = "") -> bool:
        """Whether encoding `text` in two pieces at `cut`, the second after `lead` (the text
        before `cut`) whose own ids it drops, gives the ids of one call, checked on the characters
        around it (both encodings share the window's ends)."""
        assert text.endswith(lead, 0, cut), "a lead is the text before the cut"
        before, after = text[max(cut - SEAM_CHARS, 0):cut], text[cut:cut + SEAM_CHARS]
        lead_ids = self.encode(lead)
        apart = self._tokenizer.encode_batch([before, lead + after], add_special_tokens=False)
        led_ids = apart[1].ids
        return (led_ids[:len(lead_ids)] == lead_ids
                and self.encode(before + after) == apart[0].ids + led_ids[len(lead_ids):])

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(_id_list(ids), skip_special_tokens=True)


def _line_cuts(text: str, piece_chars: int) -> list[int]:
    """Offsets about `piece_chars` apart where a line starts with a non-space character: a
    boundary of the usual pre-tokenizers' splits (GPT-2's, Llama 3's and Qwen's regexes never
    join a newline to the following word), unlike a cut inside a run of whitespace."""
    cuts = []
    newline = text.find("\n", piece_chars)
    while newline != -1 and newline + 1 < len(text):
        if text[newline + 1].isspace():
            newline = text.find("\n", newline + 1)
            continue
        cuts.append(newline + 1)
        newline = text.find("\n", newline + 1 + piece_chars)
    return cuts


def _id_bound(tokenizer) -> int:
    """One past the largest id: the rows an embedding needs. get_vocab_size counts the tokens, fewer
    where the vocabulary's ids leave gaps; an id past it was then stored wrapped (uint16 stream)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def _id_list(ids: Iterable[int]) -> list[int]:
    """Plain ints from a list, NumPy array or (any-device) torch tensor."""
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


def _load_tokenizer_json(path: str):
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"data.tokenizer={path}: needs the `tokenizers` package "
                        "(pip install 'moefold[hf]')") from None
    try:
        is_dir, is_file = Path(path).is_dir(), Path(path).is_file()
    except OSError as e:  # under a directory without search (x) permission: EACCES, not False
        raise DataError(f"data.tokenizer={path}: cannot be read ({e.strerror or e})") from None
    if is_dir:
        raise DataError(f"data.tokenizer={path}: a directory; give the tokenizer.json file itself "
                        f"(such as {Path(path) / 'tokenizer.json'})")
    if not is_file:
        raise DataError(f"data.tokenizer={path}: no such file (expected a Hugging Face "
                        "tokenizer.json; empty uses the byte-level tokenizer)")
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data.tokenizer={path}: not a valid tokenizer.json ({reason})") from None


def _find_eos_id(tokenizer, path: str) -> int:
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    config_eos = _config_eos_token(path)
    token_id = None if config_eos is None else tokenizer.token_to_id(config_eos)
    if token_id is not None:
        return token_id
    also = "" if config_eos is None else f", and the eos_token {config_eos!r} of {_CONFIG}"
    raise DataError(f"data.tokenizer={path}: no end-of-document token in the vocabulary "
                    f"(looked for {', '.join(EOS_CANDIDATES)}{also})")


_CONFIG = "tokenizer_config.json"


def tokenizer_files(path: str) -> dict[str, Path]:
    """The files of tokenizer `path` under the names Hugging Face gives them: tokenizer.json, and
    the tokenizer_config.json beside it if there is one (an export carries both). The byte-level
    tokenizer ("") has none."""
    if not path:
        return {}
    files = {"tokenizer.json": Path(path)}
    if (config := Path(path).with_name(_CONFIG)).is_file():
        files[_CONFIG] = config
    return files


def _config_eos_token(path: str) -> str | None:
    """The eos_token of the tokenizer_config.json beside `path` (a string, or an added-token dict
    with "content"); None when there is none."""
    config_path = tokenizer_files(path).get(_CONFIG)
    if config_path is None:
        return None
    try:
        config = json.loads(config_path.read_bytes())
    except ValueError as e:
        raise DataError(f"data.tokenizer={path}: {config_path}: not valid JSON ({e})") from None
    except OSError as e:
        raise DataError(f"data.tokenizer={path}: {config_path}: cannot be read "
                        f"({e.strerror or e})") from None
    if not isinstance(config, dict):
        raise DataError(f"data.tokenizer={path}: {config_path}: not a JSON object "
                        f"(a {type(config).__name__})")
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def model_vocab_size(cfg, tokenizer: Tokenizer | None = None) -> int:
    """The vocabulary a model of `cfg` is built with: model.vocab_size, or (0) the tokenizer's, as
    training takes it; the counts, plans and benchmarks use the same. A model.vocab_size below the
    tokenizer's is refused: some token ids would have no embedding row."""
    tokens = (tokenizer or build_tokenizer(cfg.data.tokenizer)).vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size < tokens:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({tokens})")
    return cfg.model.vocab_size or tokens


def build_tokenizer(path: str) -> Tokenizer:
    """The tokenizer named by `data.tokenizer`: "" is the byte-level one, else a tokenizer.json."""
    return ByteTokenizer() if not path else HFTokenizer(path)
