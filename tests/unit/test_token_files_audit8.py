"""Audit of moefold.data.token_files (eighth pass): a token file cut shorter under a run.

A stream of several token files read its windows through memory maps kept open between reads
(MAX_OPEN_TOKEN_FILES of them): a file truncated after it was mapped faulted on the next read past
its new end (SIGBUS), and the rank died without a word. The reference for the ids is
np.concatenate of the files read whole with np.fromfile / np.load.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moefold.data import token_files
from moefold.data.formats import DataFile
from moefold.data.token_files import ConcatenatedTokens, TokenFile, open_token_file
from test_data_audit7 import _live_maps, _open_fds  # this process's maps and descriptors

linux_only = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self")

_TRUNCATED_READ_SCRIPT = """
import os, sys
import numpy as np
from moefold.config import DataConfig
from moefold.data import ByteTokenizer, build_token_streams
from moefold.errors import DataError
root = sys.argv[1]
streams = build_token_streams(DataConfig(path=root, val_fraction=0.0, eos_id=3,
                                         token_dtype="uint32"), ByteTokenizer(), vocab_size=1000)
stream = streams.train_N
first = stream[:300_000].tolist()  # file 00000.bin read once: opened (mapped, before the fix)
os.truncate(os.path.join(root, "00000.bin"), 4 * 1000)  # cut to 1,000 ids in place
try:
    stream[200_000:200_100].tolist()  # past the new end
except DataError as e:
    print(e)
    sys.exit(2)
print("read past the end without an error")
"""


@pytest.mark.parametrize("num_files", [1, 2])
def test_a_token_file_truncated_after_it_was_read_is_a_one_line_error_not_sigbus(tmp_path, num_files):
    """In a subprocess: SIGBUS kills the process that reads, which would be pytest's. One file
    too: a one-file corpus (a nanoGPT-style train.bin) was its own map."""
    for i in range(num_files):
        np.full(300_000, 5 + i, dtype=np.uint32).tofile(tmp_path / f"{i:05d}.bin")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_TRUNCATED_READ_SCRIPT),
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    died_of = (f"signal {signal.Signals(-result.returncode).name}" if result.returncode < 0
               else f"exit {result.returncode}")
    assert result.returncode == 2, f"{died_of}: {result.stdout}{result.stderr[-2000:]}"
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"data.path={tmp_path}: 00000.bin: changed" in lines[0]
    assert "must not change under a run" in lines[0]


def _write_mixed(root: Path, count: int, seed: int) -> tuple[list[TokenFile], np.ndarray]:
    """`count` token files of 0 to 3,000 random ids in a mix of .bin and .npy dtypes (a big-endian
    one too), opened as corpus.py opens them; returns them and the naive reference, the files read
    whole and joined by np.concatenate in int64."""
    generator = np.random.default_rng(seed)
    kinds = [("bin", "uint16"), ("bin", "uint32"), ("bin", "int32"), ("bin", "uint64"),
             ("npy", "uint16"), ("npy", "uint32"), ("npy", "int32"), ("npy", "uint64"),
             ("npy", ">u4")]
    files, arrays = [], []
    for i in range(count):
        suffix, dtype = kinds[i % len(kinds)]
        ids_N = generator.integers(0, 60_000, int(generator.integers(1, 3001))).astype(dtype)
        path = root / f"{i:05d}.{suffix}"
        if suffix == "bin":
            ids_N.tofile(path)
            read_back_N = np.fromfile(path, dtype=dtype)
        else:
            np.save(path, ids_N)
            read_back_N = np.load(path)
        file = DataFile(path, path.name, str(root), path.stat().st_size)
        files.append(open_token_file(file, dtype, 4096)[0])
        arrays.append(read_back_N.astype(np.int64))
    return files, np.concatenate(arrays)


@linux_only
def test_random_slices_of_mixed_dtype_files_equal_their_concatenation(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 3)
    files, reference_N = _write_mixed(tmp_path, 27, seed=0)
    stream = ConcatenatedTokens.of(files)
    assert stream.dtype == np.int64 and len(stream) == len(reference_N)
    assert np.asarray(stream).tolist() == reference_N.tolist()
    generator = np.random.default_rng(1)
    for _ in range(400):  # across 0 to 27 file boundaries, nested views too
        start, stop = sorted(int(i) for i in generator.integers(0, len(stream) + 1, 2))
        part = stream[start:stop]
        assert np.asarray(part).tolist() == reference_N[start:stop].tolist(), (start, stop)
        inner = int(generator.integers(0, stop - start + 1))
        assert np.asarray(part[inner:]).tolist() == reference_N[start + inner:stop].tolist()
        pieces = list(part.pieces())  # each in its own file's dtype
        first = int(np.searchsorted(stream.offsets_F1, start, side="right")) - 1
        assert [p.dtype for p in pieces] == [f.dtype for f in files[first:first + len(pieces)]]
        joined_N = np.concatenate([np.zeros(0, np.int64), *(p.astype(np.int64) for p in pieces)])
        assert joined_N.tolist() == reference_N[start:stop].tolist()
        # No map at all (nothing to fault on); at most the cap of descriptors open.
        assert (_live_maps(tmp_path), _open_fds(tmp_path) <= 3) == (0, True), (start, stop)
    assert np.asarray(stream[5:9], dtype=np.int32).dtype == np.int32


def test_a_token_stream_pickles_as_its_files_and_reads_alike(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 2)
    files, reference_N = _write_mixed(tmp_path, 9, seed=3)
    stream = ConcatenatedTokens.of(files)[7:]
    stream[100:5000].tolist()  # some files open when pickled
    payload = pickle.dumps(stream)
    assert len(payload) < reference_N.nbytes // 10, len(payload)
    copy = pickle.loads(payload)
    assert np.asarray(copy).tolist() == reference_N[7:].tolist()
    assert np.asarray(stream).tolist() == reference_N[7:].tolist()  # the original still reads
    assert copy[10:20].tolist() == reference_N[17:27].tolist()
