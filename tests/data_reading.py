"""What the data tests read a corpus with: the byte tokenizer, a document's tokens by the naive
reference (its UTF-8 bytes, then EOS), and the token streams moefold.data builds from a path."""

from pathlib import Path

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, build_token_streams

BYTES = ByteTokenizer()
EOS = BYTES.eos_id


def byte_doc(text: str) -> list[int]:
    """Naive reference: a document's UTF-8 bytes followed by EOS."""
    return list(text.encode("utf-8")) + [EOS]


def streams_of(path: Path, tokenizer=BYTES, **overrides):
    return build_token_streams(DataConfig(path=str(path), **overrides), tokenizer)
