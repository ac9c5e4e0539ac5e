"""Audit of moefold.data.token_files (ninth pass): startup reads token files without a map.

Startup mapped each file once to read its header and its head (the ids checked against the
vocabulary): a file cut shorter in that window faulted (SIGBUS) like a mapped read during training
did before the eighth pass. Startup now reads them with positioned reads too. References: the
headers and ids as np.load / np.fromfile read them.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, build_token_streams
from moefold.data.formats import DataFile
from moefold.data import token_files
from moefold.data.token_files import HeadIds, open_token_file
from moefold.errors import DataError


def _data_file(path) -> DataFile:
    return DataFile(path, path.name, str(path.parent), path.stat().st_size)


def _refuse_maps(*args, **kwargs):
    raise AssertionError("a token file was memory-mapped")


def test_startup_maps_no_token_file(tmp_path, monkeypatch):
    """np.memmap and np.load(mmap_mode=...) both map through mmap.mmap."""
    np.arange(5, 3005, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", np.arange(7, 2007, dtype=np.uint16))
    monkeypatch.setattr(mmap, "mmap", _refuse_maps)
    streams = build_token_streams(DataConfig(path=str(tmp_path), val_fraction=0.0, eos_id=3),
                                  ByteTokenizer(), vocab_size=60_000)
    assert np.asarray(streams.train_N).tolist() == [*range(5, 3005), *range(7, 2007)]


@pytest.mark.parametrize("dtype", ["uint16", "<i4", ">u4", "uint64"])
@pytest.mark.parametrize("length", [1, 63, 5000])
@pytest.mark.parametrize("head_tokens", [100, 4096])
def test_layout_and_head_equal_numpys_reading(tmp_path, monkeypatch, dtype, length, head_tokens):
    """The head is read 1,000 ids a piece here, so that pieces end inside it."""
    monkeypatch.setattr(token_files, "HEAD_PIECE_IDS", 1000)
    ids_N = np.random.default_rng(length).integers(0, 50_000, length).astype(dtype)
    head_N = ids_N[:head_tokens]
    expected = HeadIds(int(head_N.min()), int(head_N.max()), len(head_N))
    np.save(tmp_path / "x.npy", ids_N)
    layout, head = open_token_file(_data_file(tmp_path / "x.npy"), "uint16", head_tokens)
    reference_N = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert (layout.dtype, layout.offset, layout.length) == (reference_N.dtype, reference_N.offset, length)
    assert head == expected
    native = np.dtype(dtype).newbyteorder("=")
    ids_N.astype(native).tofile(tmp_path / "x.bin")
    layout, head = open_token_file(_data_file(tmp_path / "x.bin"), native.name, head_tokens)
    assert (layout.dtype, layout.offset, layout.length) == (native, 0, length) and head == expected


@pytest.mark.parametrize("head_tokens", [64, 5000])
def test_uint32_ids_read_as_uint16_are_refused_across_pieces(tmp_path, monkeypatch, head_tokens):
    """Judged over the whole head: a nonzero odd id in a later piece clears the file."""
    monkeypatch.setattr(token_files, "HEAD_PIECE_IDS", 1000)
    ids_N = np.arange(1, 6001, dtype=np.uint32)
    ids_N.tofile(tmp_path / "wide.bin")
    with pytest.raises(DataError, match=f"every second uint16 id is 0 in its first {head_tokens} ids"):
        open_token_file(_data_file(tmp_path / "wide.bin"), "uint16", head_tokens)
    ids_N.view(np.uint16)[4001] = 7  # odd position 4,001: in the fifth piece
    ids_N.tofile(tmp_path / "wide.bin")
    open_token_file(_data_file(tmp_path / "wide.bin"), "uint16", 5000)
    with pytest.raises(DataError, match="every second uint16 id is 0 in its first 4000 ids"):
        open_token_file(_data_file(tmp_path / "wide.bin"), "uint16", 4000)


def test_a_file_cut_shorter_after_it_was_listed_is_a_one_line_error(tmp_path):
    """The size the file had when data.path was searched, then a shorter file: read, not mapped,
    this is the DataError every later read gives."""
    np.arange(4000, dtype=np.uint32).tofile(tmp_path / "a.bin")
    file = _data_file(tmp_path / "a.bin")
    with open(tmp_path / "a.bin", "r+b") as f:
        f.truncate(400)
    with pytest.raises(DataError, match=r"^data\.path=.*a\.bin: changed since training started"):
        open_token_file(file, "uint32", 4096)


def test_an_npy_header_promising_more_ids_than_the_file_holds(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.uint32))
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(data[:-8])  # two ids short
    with pytest.raises(DataError, match=r"x\.npy: not a valid \.npy file \(its header promises 1000 ids"):
        open_token_file(_data_file(tmp_path / "x.npy"), "uint16", 100)
