"""Audit of moefold.data against naive references: inputs that reached the user as tracebacks
(file names that are not UTF-8, pathological JSON lines, odd .npy dtypes)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, build_token_streams
from moefold.errors import DataError

BYTES = ByteTokenizer()


def byte_doc(raw: bytes) -> list[int]:
    """Naive reference: a document's bytes followed by EOS."""
    return list(raw) + [BYTES.eos_id]


def streams_of(path: Path, **overrides):
    return build_token_streams(DataConfig(path=str(path), **overrides), BYTES)


def test_a_file_name_that_is_not_utf8_is_split_by_its_bytes(tmp_path):
    """A Latin-1 file name (b'caf\\xe9.txt', as Linux allows) crashed the split with
    UnicodeEncodeError ('surrogates not allowed'); it hashes as the name's bytes."""
    names = [b"caf\xe9.txt", b"plain.txt", b"na\xefve.txt", b"\xff\xfe.txt"]
    texts = {name: b"text of " + name + b"\n" for name in names}
    for name, text in texts.items():
        (tmp_path / os.fsdecode(name)).write_bytes(text)
    streams = streams_of(tmp_path, val_fraction=0.5)
    # Naive reference: files in sorted order, held out by the crc32 of the raw name's bytes.
    by_name = sorted(names, key=os.fsdecode)
    held = {name: zlib.crc32(name) % 10_000 < 5000 for name in names}
    assert any(held.values()) and not all(held.values())  # both sides nonempty as drawn
    decoded = {n: texts[n].decode("utf-8", errors="replace").encode("utf-8") for n in names}
    assert streams.val_N.tolist() == [t for n in by_name if held[n] for t in byte_doc(decoded[n])]
    assert streams.train_N.tolist() == [t for n in by_name if not held[n]
                                        for t in byte_doc(decoded[n])]


@pytest.mark.parametrize("line", ["[" * 100_000, '{"a": ' * 100_000], ids=["arrays", "objects"])
def test_a_deeply_nested_jsonl_line_is_a_one_line_error(tmp_path, line):
    """A line of 100,000 nested arrays or objects ended in json's RecursionError traceback."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=r"^data\.path=.*deep\.jsonl: line 2: JSON nested too "
                                        r"deeply to read \(one flat object per line\)$"):
        streams_of(path)


@pytest.mark.parametrize("dtype", ["m8[s]", "M8[D]", "?", "f2"])
def test_an_npy_of_no_integer_ids_is_refused_by_name(tmp_path, dtype):
    """A timedelta64 array passed the integer check (NumPy calls it an integer type) and ended in
    a TypeError traceback at the vocabulary check."""
    path = tmp_path / "ids.npy"
    np.save(path, np.zeros(8, dtype=dtype))
    with pytest.raises(DataError, match=r"^data\.path=.*ids\.npy: expected a 1-D integer array of "
                                        r"token ids, got shape \(8,\) of "):
        streams_of(path)
