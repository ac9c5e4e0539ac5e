"""What the data tests read a corpus with: the byte tokenizer, a document's tokens by the naive
reference (its UTF-8 bytes, then EOS), the token streams moefold.data builds from a path, and a
file that cannot be read."""

import builtins
import errno
import io
import os
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


def deny_read(monkeypatch, path: Path) -> None:
    """Opening `path` fails as a file without read permission does (tests may run as root, whom
    permissions do not stop)."""
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)  # Path.open, Path.read_bytes
