"""Audit of moefold.data's file handling and tokenization against independent readings: the json
module and NumPy for the formats, naive Python for packing and the split, transformers for the
tokenizer, the loader's global batch against every data-parallel split of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, build_token_streams
from moefold.data.formats import find_data_files

BYTES = ByteTokenizer()
EOS = BYTES.eos_id


def byte_doc(text: str) -> list[int]:
    """Naive reference: a document's UTF-8 bytes followed by EOS."""
    return list(text.encode("utf-8")) + [EOS]


def streams_of(path: Path, tokenizer=BYTES, **overrides):
    return build_token_streams(DataConfig(path=str(path), **overrides), tokenizer)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Symlinks: one file, one weight
# ---------------------------------------------------------------------------------------------


def test_a_symlinked_file_in_the_data_directory_is_read_once(tmp_path):
    """b.txt -> a.txt beside it, and sub/c.txt -> ../a.txt: a.txt's text was trained on three
    times. Files are deduplicated by resolved path, the first name in sorted order kept."""
    data = tmp_path / "data"
    _write(data / "a.txt", "alpha")
    _write(data / "z.txt", "omega")
    (data / "b.txt").symlink_to("a.txt")
    (data / "sub").mkdir()
    (data / "sub" / "c.txt").symlink_to(Path("..", "a.txt"))
    (data / "y.txt").symlink_to(data / "z.txt")  # absolute target: first name is the link
    assert [f.name for f in find_data_files(str(data))] == ["a.txt", "y.txt"]
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == byte_doc("alpha") + byte_doc("omega")
    assert streams.train_docs == 2


def test_a_token_file_behind_a_symlink_is_read_once(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.arange(10, dtype=np.uint16))
    (data / "b.npy").symlink_to("a.npy")
    streams = streams_of(data, val_fraction=0.0)
    assert streams.train_N.tolist() == list(range(10))


def test_a_file_reached_through_a_symlinked_directory_and_directly_is_read_once(tmp_path):
    """A symlinked directory whose target is outside data.path holds a link back to a file inside
    it: the directory walk deduplicated directories only."""
    data = tmp_path / "data"
    _write(data / "a.txt", "alpha")
    outside = tmp_path / "outside"
    _write(outside / "o.txt", "outer")
    (outside / "back.txt").symlink_to(data / "a.txt")
    (data / "more").symlink_to(outside, target_is_directory=True)
    assert [f.name for f in find_data_files(str(data))] == ["a.txt", "more/o.txt"]
