"""Audit of moefold.data (seventh pass): token files at scale, and the train loader against a naive
reference.

A corpus of many token files is one stream that holds only a bounded number of them memory-mapped
at once (Linux allows vm.max_map_count = 65,530 mappings a process, and each np.memmap holds a
file descriptor, often 1,024 a process): the reference for its ids is np.concatenate of the files
read whole; the bound is counted in /proc/self/maps and /proc/self/fd.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moefold.config import DataConfig
from moefold.data import ByteTokenizer, PackedSequences, TrainLoader, build_token_streams
from moefold.data import token_files
from moefold.data.loader import val_batches
from moefold.errors import DataError

BYTES = ByteTokenizer()
VOCAB = 100_000
EOS = 3

linux_only = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self")


def _streams(root: Path, val_fraction: float = 0.0):
    cfg = DataConfig(path=str(root), val_fraction=val_fraction, eos_id=EOS)
    return build_token_streams(cfg, BYTES, vocab_size=VOCAB)


def _write_shards(root: Path, count: int, seed: int = 0, max_len: int = 40) -> np.ndarray:
    """`count` token files of 1 to `max_len` random ids below 120, in a mix of .npy dtypes (a
    big-endian one too) and .bin uint16; returns the naive reference: the files read whole, in
    name order, joined by np.concatenate."""
    generator = np.random.default_rng(seed)
    dtypes = ["uint16", "int32", "uint8", ">u2", "bin"]
    arrays = []
    for i in range(count):
        kind = dtypes[i % len(dtypes)]
        ids_N = generator.integers(0, 120, generator.integers(1, max_len + 1))
        if kind == "bin":
            ids_N.astype(np.uint16).tofile(root / f"{i:05d}.bin")
        else:
            np.save(root / f"{i:05d}.npy", ids_N.astype(kind))
        arrays.append(ids_N)
    return np.concatenate(arrays)


def _live_maps(root: Path) -> int:
    """Mappings of files under `root` this process holds (one /proc/self/maps line per mmap)."""
    with open("/proc/self/maps") as maps:
        return sum(f" {root}/" in line for line in maps)


def _open_fds(root: Path) -> int:
    """File descriptors of this process open on files under `root` (each mmap holds one)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return count


# ---------------------------------------------------------------------------------------------
# 1. Many token files: a bounded number mapped at once, the same ids as their concatenation
# ---------------------------------------------------------------------------------------------


@linux_only
def test_many_token_files_hold_a_bounded_number_of_maps_and_read_their_concatenation(
        tmp_path, monkeypatch):
    # raising=False: on code without the cap the bound below is what fails, not this line.
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 3, raising=False)
    reference_N = _write_shards(tmp_path, 48)
    streams = _streams(tmp_path, val_fraction=0.1)
    assert (_live_maps(tmp_path), _open_fds(tmp_path)) <= (3, 3), "after startup"
    num_val = round(len(reference_N) * 0.1)
    split = len(reference_N) - num_val
    assert np.asarray(streams.train_N).tolist() == reference_N[:split].tolist()
    assert np.asarray(streams.val_N).tolist() == reference_N[split:].tolist()
    generator = np.random.default_rng(1)
    for _ in range(300):  # slices across 0 to 48 file boundaries, of both sides, nested too
        start, stop = sorted(generator.integers(0, split + 1, 2))
        part = streams.train_N[start:stop]
        assert np.asarray(part).tolist() == reference_N[start:stop].tolist(), (start, stop)
        inner = int(generator.integers(0, stop - start + 1))
        assert np.asarray(part[inner:]).tolist() == reference_N[start + inner:stop].tolist()
        assert _live_maps(tmp_path) <= 3 and _open_fds(tmp_path) <= 3, (start, stop)
    assert _live_maps(tmp_path) <= 3


@linux_only
def test_many_token_files_give_the_batches_of_their_concatenation_with_few_maps(
        tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 2, raising=False)
    reference_N = _write_shards(tmp_path, 40, seed=2)
    streams = _streams(tmp_path, val_fraction=0.2)
    split = len(reference_N) - round(len(reference_N) * 0.2)
    loader = TrainLoader(PackedSequences(streams.train_N, 9), 4, seed=7, eos_id=EOS,
                         vocab=streams.vocab, step_size=8)
    naive = TrainLoader(PackedSequences(reference_N[:split], 9), 4, seed=7, eos_id=EOS, step_size=8)
    for _ in range(3 * len(loader.sequences) // 4):  # a few epochs
        got, want = next(loader), next(naive)
        assert torch.equal(got.input_ids_BS, want.input_ids_BS)
        assert torch.equal(got.labels_BS, want.labels_BS)
        assert torch.equal(got.doc_ids_BS, want.doc_ids_BS)
    got_val = val_batches(PackedSequences(streams.val_N, 9), 2, 4, EOS, vocab=streams.vocab)
    want_val = val_batches(PackedSequences(reference_N[split:], 9), 2, 4, EOS)
    assert [torch.equal(a.input_ids_BS, b.input_ids_BS) for a, b in zip(got_val, want_val,
                                                                       strict=True)] == [True] * 4
    assert _live_maps(tmp_path) <= 2 and _open_fds(tmp_path) <= 2


def test_a_token_stream_pickles_as_its_files_not_their_ids(tmp_path):
    """What a DataLoader worker or a spawned process receives: pickling np.memmaps wrote their
    ids (the whole corpus) into the pickle."""
    reference_N = _write_shards(tmp_path, 6, max_len=100_000)
    corpus_bytes = sum(path.stat().st_size for path in tmp_path.iterdir())
    stream = _streams(tmp_path).train_N
    stream[10:90_000].tolist()  # some files mapped when pickled
    payload = pickle.dumps(stream[5:])
    assert len(payload) < corpus_bytes // 20, f"{len(payload)} bytes pickled of {corpus_bytes}"
    assert np.asarray(pickle.loads(payload)).tolist() == reference_N[5:].tolist()


_FD_LIMIT_SCRIPT = """
import os, resource, sys
import numpy as np
from moefold.config import DataConfig
from moefold.data import ByteTokenizer, PackedSequences, TrainLoader, build_token_streams
in_use = len(os.listdir("/proc/self/fd"))
hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 200, hard_limit))
streams = build_token_streams(DataConfig(path=sys.argv[1], val_fraction=0.0, eos_id=3),
                              ByteTokenizer(), vocab_size=1000)
loader = TrainLoader(PackedSequences(streams.train_N, 8), 16, seed=0, eos_id=3)
ids = [next(loader).input_ids_BS.sum().item() for _ in range(50)]
print(np.asarray(streams.train_N).sum(), sum(ids))
"""


@linux_only
def test_more_token_files_than_the_open_file_limit_train(tmp_path):
    """The failure users hit: `ulimit -n` (often 1,024) below the number of shards. Here a limit
    of 200 descriptors beyond those in use, and 400 files, under the default cap."""
    reference_N = _write_shards(tmp_path, 400)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_FD_LIMIT_SCRIPT),
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1]
    assert int(result.stdout.split()[0]) == int(reference_N.sum())


def test_a_token_file_replaced_after_startup_is_a_one_line_error(tmp_path, monkeypatch):
    """Files are mapped again on demand: one that changed under the run is named, not misread
    (a shorter file read through a longer map faults with SIGBUS)."""
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 1, raising=False)
    _write_shards(tmp_path, 4, max_len=20)
    stream = _streams(tmp_path).train_N
    with open(tmp_path / "new", "wb") as new:
        np.save(new, np.arange(1, dtype=np.uint16))
    os.replace(tmp_path / "new", tmp_path / "00000.npy")  # a new, shorter file
    with pytest.raises(DataError, match=r"data.path=.*: 00000.npy: .*changed"):
        stream[:3].tolist()


def test_a_token_file_removed_after_startup_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 1, raising=False)
    _write_shards(tmp_path, 4, max_len=20)
    stream = _streams(tmp_path).train_N
    (tmp_path / "00000.npy").unlink()
    with pytest.raises(DataError, match=r"data.path=.*: 00000.npy: cannot be read"):
        stream[:3].tolist()


def test_an_npy_file_with_bytes_past_its_array_reads_as_numpy_loads_it(tmp_path, monkeypatch):
    """np.load maps the array and ignores what follows it; mapped again, the file reads alike."""
    monkeypatch.setattr(token_files, "MAX_OPEN_TOKEN_FILES", 1, raising=False)
    reference_N = _write_shards(tmp_path, 3, max_len=20)
    with open(tmp_path / "00001.npy", "ab") as shard:
        shard.write(b"\0" * 7)
    stream = _streams(tmp_path).train_N
    assert np.asarray(stream).tolist() == reference_N.tolist()
    assert np.asarray(stream).tolist() == reference_N.tolist()  # every file mapped again


def _ids_read_at_startup(monkeypatch, root: Path) -> int:
    """Ids sliced out of the token files' maps while the streams are built (each check reads the
    head it slices)."""
    read = []
    real_getitem = np.memmap.__getitem__

    def counting_getitem(self, key):
        part = real_getitem(self, key)
        read.append(np.size(part) if isinstance(key, slice) else 0)
        return part

    with monkeypatch.context() as patched:
        patched.setattr(np.memmap, "__getitem__", counting_getitem)
        _streams(root)
    return sum(read)


def test_startup_reads_a_bounded_number_of_ids_however_many_token_files(tmp_path, monkeypatch):
    """Each file's head was checked (ids, and a .bin file's width) up to ~1M ids: 2 MiB a uint16
    shard, 128 GiB read at startup by every rank for 65k shards. The heads now share a budget
    (here 16 · 4,096 ids), each at least 4,096 ids."""
    from moefold.data import corpus

    monkeypatch.setattr(corpus, "_STARTUP_CHECK_TOKENS", 16 * 4096, raising=False)
    files = 64
    for i in range(files):
        np.arange(20_000, dtype=np.uint16).tofile(tmp_path / f"{i:03d}.bin")
    assert _ids_read_at_startup(monkeypatch, tmp_path) <= 2 * files * 4096  # ids, then width


def test_a_token_file_among_many_is_still_checked_at_startup(tmp_path, monkeypatch):
    """The reduced heads still refuse a wrong width or an id past the vocabulary in any file."""
    from moefold.data import corpus

    monkeypatch.setattr(corpus, "_STARTUP_CHECK_TOKENS", 4096, raising=False)
    for i in range(30):
        np.arange(10_000, dtype=np.uint16).tofile(tmp_path / f"{i:03d}.bin")
    np.arange(10_000, dtype=np.uint32).tofile(tmp_path / "017.bin")
    with pytest.raises(DataError, match=r"017.bin: every second uint16 id is 0"):
        _streams(tmp_path)
    ids_N = np.arange(10_000, dtype=np.uint16)
    ids_N[4000] = 60_000
    ids_N.tofile(tmp_path / "017.bin")
    with pytest.raises(DataError, match=r"017.bin: token id 60000 is outside the vocabulary"):
        build_token_streams(DataConfig(path=str(tmp_path), eos_id=EOS), BYTES, vocab_size=50_000)


# ---------------------------------------------------------------------------------------------
# 2. The train loader against a naive reference, over random layouts, epochs and resumes
# ---------------------------------------------------------------------------------------------

SEQ = 3


def _naive_steps(num_sequences: int, seed: int, step_size: int, steps: int) -> list[list[int]]:
    """Each step's sequence indices: epoch e visits randperm(n) seeded seed * 1_000_003 + e, cut
    into whole steps (the rest dropped); a step longer than an epoch reads epochs back to back."""
    flat: list[int] = []
    epoch = 0
    while len(flat) < steps * step_size:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
        order = torch.randperm(num_sequences, generator=generator).tolist()
        whole = len(order) if step_size > num_sequences else len(order) // step_size * step_size
        flat += order[:whole]
        epoch += 1
    return [flat[s * step_size:(s + 1) * step_size] for s in range(steps)]


def _rank_rows(num_sequences: int, seed: int, split: tuple[int, int, int], steps: int,
               state: dict | None = None) -> tuple[list[list[list[int]]], dict]:
    """Per step, each data rank's sequence indices (its rows of every micro-batch, as its own
    loader reads them, data_rank of dp), and the loaders' (common) state after the last step."""
    micro, dp, accum = split
    sequences = PackedSequences(np.arange(num_sequences * SEQ + 1), SEQ)
    loaders = [TrainLoader(sequences, micro * dp, seed, eos_id=-1, step_size=micro * dp * accum,
                           data_rank=rank, data_ranks=dp) for rank in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        per_rank: list[list[int]] = [[] for _ in range(dp)]
        for _ in range(accum):
            for rank, loader in enumerate(loaders):
                batch = loader.next_batch()
                assert torch.equal(batch.labels_BS[:, :-1], batch.input_ids_BS[:, 1:])
                assert batch.input_ids_BS.shape == (micro, SEQ)
                per_rank[rank] += (batch.input_ids_BS[:, 0] // SEQ).tolist()
        out.append(per_rank)
    assert all(loader.state_dict() == loaders[0].state_dict() for loader in loaders)
    return out, loaders[0].state_dict()


def _random_split(generator: np.random.Generator, step_size: int,
                  num_sequences: int) -> tuple[int, int, int]:
    """A random (micro_batch_size, dp, grad_accum) whose product is `step_size`, its global
    micro-batch (micro_batch_size · dp) within the sequences, as the loader requires."""
    divisors = [d for d in range(1, step_size + 1) if step_size % d == 0]
    splits = [(micro, dp, step_size // (micro * dp)) for dp in divisors for micro in divisors
              if step_size % (micro * dp) == 0 and micro * dp <= num_sequences]
    return splits[int(generator.integers(len(splits)))]


@pytest.mark.parametrize("case", range(40))
def test_random_layouts_epochs_and_resumes_read_the_naive_steps(case):
    """Steps across several epochs (some steps longer than an epoch), split over random data
    ranks and micro-batches, cut at a random step and resumed under another split of the same
    global batch: rank r reads rows [r·micro, (r+1)·micro) of each micro-batch of the naive
    step, so the ranks' rows are disjoint and together the step one process reads."""
    generator = np.random.default_rng(case)
    num_sequences = int(generator.integers(2, 40))
    step_size = int(generator.choice([1, 2, 4, 6, 8, 12, 16, 24]))
    seed = int(generator.integers(0, 2**63 - 1)) if case % 4 == 0 else case
    steps = 3 * num_sequences // step_size + 3  # past a few epoch ends
    first = _random_split(generator, step_size, num_sequences)
    then = _random_split(generator, step_size, num_sequences)
    reference = _naive_steps(num_sequences, seed, step_size, steps)
    cut = int(generator.integers(0, steps + 1))
    before, state = _rank_rows(num_sequences, seed, first, cut)
    after, _ = _rank_rows(num_sequences, seed, then, steps - cut, state)
    for s, per_rank in enumerate(before + after):
        micro, dp, accum = first if s < cut else then
        for rank, rows in enumerate(per_rank):
            expected = [reference[s][m * micro * dp + rank * micro + j]
                        for m in range(accum) for j in range(micro)]
            assert rows == expected, (s, cut, first, then, rank)
