"""Audit of moefold.data (third pass) against independent readings: os.stat's (st_dev, st_ino) for
which paths are one file, Python's utf-8-sig codec for byte-order marks, a naive walk for the files
skipped, torch.randperm for the epoch order, naive step and validation orders for resumes and
data-parallel splits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from data_reading import EOS, streams_of

from moefold.data import PackedSequences, TrainLoader
from moefold.data.formats import find_data_files
from moefold.errors import DataError

BOM = b"\xef\xbb\xbf"


def all_ids(path: Path) -> list[int]:
    streams = streams_of(path, val_fraction=0.0)
    return streams.train_N.tolist()


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


# ---------------------------------------------------------------------------------------------
# 1. Hard links: one file on disk, one weight
# ---------------------------------------------------------------------------------------------


def _unique_by_inode(paths: list[Path]) -> list[str]:
    """Naive reference: sorted relative names, the first of each (st_dev, st_ino)."""
    seen, names = set(), []
    for path in paths:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            names.append(path)
    return names


def test_hard_links_to_one_file_are_read_once_under_the_first_name(tmp_path):
    data = tmp_path / "data"
    a = _write(data / "sub" / "a.txt", "alpha document")
    _write(data / "m.txt", "middle")
    os.link(a, data / "b.txt")  # sorts before sub/a.txt: it is the name kept
    (data / "z").mkdir()
    os.link(a, data / "z" / "c.txt")
    names = sorted(p.relative_to(data).as_posix() for p in data.rglob("*.txt"))
    expected = _unique_by_inode([data / n for n in names])
    assert [f.name for f in find_data_files(str(data))] == [
        p.relative_to(data).as_posix() for p in expected] == ["b.txt", "m.txt"]
    ids = all_ids(data)
    assert ids == list(b"alpha document") + [EOS] + list(b"middle") + [EOS]


# ---------------------------------------------------------------------------------------------
# 2. A UTF-8 byte-order mark is no text
# ---------------------------------------------------------------------------------------------


def test_a_leading_utf8_bom_in_a_txt_file_is_dropped_as_utf8_sig_does(tmp_path):
    raw = BOM + "héllo\ufeffworld\n".encode("utf-8")  # a BOM further on is text (ZWNBSP)
    _write(tmp_path / "a.txt", raw)
    assert all_ids(tmp_path / "a.txt") == list(raw.decode("utf-8-sig").encode("utf-8")) + [EOS]
    assert all_ids(tmp_path / "a.txt")[:1] == [ord("h")]


def test_a_bom_on_jsonl_lines_is_dropped_as_utf8_sig_does(tmp_path):
    lines = [BOM + json.dumps({"text": "one"}).encode(), json.dumps({"text": "\ufefftwo"}).encode()]
    _write(tmp_path / "a.jsonl", b"\n".join(lines) + b"\n")
    expected = [json.loads(line.decode("utf-8-sig"))["text"] for line in lines]
    assert expected == ["one", "\ufefftwo"]  # a BOM inside a string is the document's own
    assert all_ids(tmp_path / "a.jsonl") == [i for text in expected
                                             for i in list(text.encode("utf-8")) + [EOS]]


def test_a_txt_file_of_only_a_bom_is_no_document(tmp_path):
    _write(tmp_path / "data" / "a.txt", "text")
    _write(tmp_path / "data" / "b.txt", BOM)
    with pytest.raises(DataError, match=r"b\.txt: no documents"):
        streams_of(tmp_path / "data")


# ---------------------------------------------------------------------------------------------
# 3. Files of other types are said, not silently passed over
# ---------------------------------------------------------------------------------------------


def test_files_the_loader_does_not_read_are_counted_on_the_source_line(tmp_path):
    data = tmp_path / "data"
    _write(data / "a.txt", "the only document read")
    for name in ("s0.json.gz", "s1.json.gz", "sub/s2.json.gz", "meta.json", "README"):
        _write(data / name, "x")
    _write(data / ".hidden.gz", "x")  # hidden entries are no data, not "skipped"
    source = streams_of(data, val_fraction=0.0).source
    assert source == (f"{data}: 1 file, 0.0 MB; skipped 5 files of types the loader does not read"
                      f" (3 .json.gz, 1 (no suffix), 1 .json)"), source


def test_a_directory_of_only_unreadable_types_names_what_it_found_and_what_is_allowed(tmp_path):
    data = tmp_path / "data"
    for i in range(3):
        _write(data / f"shard{i}.jsonl.gz", "x")
    _write(data / "shard.parquet.zst", "x")
    with pytest.raises(DataError) as info:
        streams_of(data)
    message = str(info.value)
    assert message == (f"data.path={data}: no .txt, .jsonl, .parquet, .npy or .bin files found "
                       "(found 3 .jsonl.gz, 1 .parquet.zst; decompress them)"), message


def test_a_directory_of_no_files_but_hidden_ones_says_so(tmp_path):
    _write(tmp_path / "data" / "sub" / ".a.txt", "hidden")
    with pytest.raises(DataError, match=r"files found \(found no files; hidden ones \(\.name\) "
                                        r"are not data\)$"):
        streams_of(tmp_path / "data")


# ---------------------------------------------------------------------------------------------
# 4. The epoch order: torch.randperm's, in 4 bytes an index
# ---------------------------------------------------------------------------------------------


def test_the_epoch_order_is_randperm_of_the_seed_held_in_int32():
    sequences = PackedSequences(np.arange(1001 * 8 + 1), 8)
    loader = TrainLoader(sequences, 4, seed=7, eos_id=-1)
    for epoch in (0, 3):
        generator = torch.Generator().manual_seed(7 * 1_000_003 + epoch)
        reference_N = torch.randperm(1001, generator=generator)  # int64: the order saved runs had
        order_N = loader.epoch_order(epoch)
        assert torch.equal(order_N.long(), reference_N)
        assert order_N.element_size() == 4, order_N.dtype  # 244M sequences: 1 GB, not 2


def test_a_jsonl_line_of_only_a_bom_is_blank_as_utf8_sig_reads_it(tmp_path):
    """Notepad's BOM on a blank first line; `cat` of two such files puts one mid-file."""
    raw = BOM + b"\r\n" + b'{"text": "one"}\r\n' + BOM + b"\n" + BOM + b'{"text": "two"}\n'
    _write(tmp_path / "a.jsonl", raw)
    with open(tmp_path / "a.jsonl", encoding="utf-8-sig") as f:  # the first line's BOM only
        lines = [line.removeprefix("\ufeff") for line in f]
    expected = [json.loads(line)["text"] for line in lines if line.strip()]
    assert expected == ["one", "two"]
    assert all_ids(tmp_path / "a.jsonl") == [i for text in expected
                                             for i in list(text.encode("utf-8")) + [EOS]]


# ---------------------------------------------------------------------------------------------
# Resume and data-parallel splits against a naive reference order
# ---------------------------------------------------------------------------------------------

SEQ = 4


def _reference_steps(num_sequences: int, seed: int, step_size: int, steps: int) -> list[list[int]]:
    """Naive reference: epoch e is randperm(n, seed * 1_000_003 + e) cut into whole steps, the
    rest dropped (step_size <= n)."""
    out, epoch = [], 0
    while len(out) < steps:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_sequences, generator=generator).tolist()
        out += [order[j:j + step_size] for j in range(0, num_sequences - step_size + 1, step_size)]
        epoch += 1
    return out[:steps]


def _loader(num_sequences: int, seed: int, micro: int, dp: int, accum: int) -> TrainLoader:
    sequences = PackedSequences(np.arange(num_sequences * SEQ + 1), SEQ)
    return TrainLoader(sequences, micro * dp, seed, eos_id=-1, step_size=micro * dp * accum)


def _run_steps(loader: TrainLoader, dp: int, accum: int, steps: int) -> list[list[int]]:
    """Each step's sequences as the data ranks' rows (tensor_split, as the trainer takes them),
    rank by rank within each micro-batch, micro-batch by micro-batch."""
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            rows_B = loader.next_batch().input_ids_BS[:, 0] // SEQ
            step += [i for part in rows_B.tensor_split(dp) for i in part.tolist()]
        out.append(step)
    return out


@pytest.mark.parametrize("num_sequences", [24, 29, 37])
def test_resuming_mid_epoch_under_any_split_gives_the_reference_steps(num_sequences):
    """A global step of 12 sequences, as (micro, dp, accum) = (12, 1, 1) ... (1, 4, 3); a run cut
    at every step and resumed under each other split trains what an uninterrupted run does."""
    splits = [(12, 1, 1), (6, 2, 1), (3, 4, 1), (2, 2, 3), (1, 4, 3), (2, 1, 6)]
    steps, seed = 9, 5
    reference = _reference_steps(num_sequences, seed, 12, steps)
    for micro, dp, accum in splits:
        assert _run_steps(_loader(num_sequences, seed, micro, dp, accum), dp, accum,
                          steps) == reference, (micro, dp, accum)
    for cut in range(1, steps):
        first = splits[cut % len(splits)]
        then = splits[(cut * 5 + 1) % len(splits)]
        loader = _loader(num_sequences, seed, *first)
        before = _run_steps(loader, first[1], first[2], cut)
        resumed = _loader(num_sequences, seed, *then)
        resumed.load_state_dict(dict(loader.state_dict()))
        after = _run_steps(resumed, then[1], then[2], steps - cut)
        assert before + after == reference, (cut, first, then)


@pytest.mark.parametrize("num_sequences, micro, num_batches", [(10, 3, 5), (7, 2, 2), (2, 3, 4)])
def test_validation_holds_the_same_sequences_on_any_number_of_data_ranks(num_sequences, micro,
                                                                         num_batches):
    from moefold.data import val_batches

    sequences = PackedSequences(np.arange(num_sequences * SEQ + 1), SEQ)
    # Naive reference: the first num_batches · micro sequences in stream order, at least one batch,
    # never past the end (whole batches of min(micro, n)).
    b = min(micro, num_sequences)
    expected = list(range(max(1, min(num_batches, num_sequences // b)) * b))
    for dp in (1, 2, 3, 4):
        batches = val_batches(sequences, micro, num_batches, -1, data_ranks=dp)
        seen = [i for batch in batches for i in (batch.input_ids_BS[:, 0] // SEQ).tolist()]
        assert seen == expected, dp
        assert all(len(batch.input_ids_BS) <= b * dp for batch in batches)


# ---------------------------------------------------------------------------------------------
# .bin width: uint32 ids read as uint16
# ---------------------------------------------------------------------------------------------


def test_uint32_ids_read_as_uint16_are_refused_not_trained_as_other_ids(tmp_path):
    """Little-endian uint32 ids below 65,536 read as uint16 are each id then a 0 (np.frombuffer
    says so): every one inside the vocabulary, so no id check caught it."""
    ids_N = np.random.default_rng(0).integers(1, 250, 5000).astype(np.uint32)
    ids_N.tofile(tmp_path / "a.bin")
    as_uint16 = np.fromfile(tmp_path / "a.bin", dtype=np.uint16)
    assert (as_uint16[1::2] == 0).all() and (as_uint16[0::2] == ids_N).all()  # the misreading
    with pytest.raises(DataError, match=r"a\.bin: .*every second uint16 id is 0.*"
                                        r"data\.token_dtype=uint32"):
        streams_of(tmp_path / "a.bin", val_fraction=0.0)
    right = streams_of(tmp_path / "a.bin", val_fraction=0.0, token_dtype="uint32")
    assert right.train_N.tolist() == ids_N.tolist()


def test_uint16_ids_with_zeros_among_them_are_read_as_uint16(tmp_path):
    """Id 0 is an ordinary token (byte 0, GPT-2's '!'): a file where it is frequent, even at most
    odd positions, is not mistaken for uint32."""
    ids_N = np.zeros(5000, dtype=np.uint16)
    ids_N[0::2] = np.random.default_rng(1).integers(1, 250, 2500)
    ids_N[4001] = 7  # one nonzero odd position
    ids_N.tofile(tmp_path / "a.bin")
    assert streams_of(tmp_path / "a.bin", val_fraction=0.0).train_N.tolist() == ids_N.tolist()
    short_N = np.array([3, 0, 5, 0], dtype=np.uint16)  # too short to judge
    short_N.tofile(tmp_path / "b.bin")
    assert streams_of(tmp_path / "b.bin", val_fraction=0.0).train_N.tolist() == short_N.tolist()


def test_the_package_docstring_example_runs(tmp_path):
    """moefold.data's docstring is its usage: run it as written, on a small corpus."""
    import textwrap

    import moefold.data
    from moefold.config import Config

    _write(tmp_path / "a.txt", "some text to train on, " * 40)
    _write(tmp_path / "b.txt", "and other text to validate on. " * 40)
    cfg = Config()
    cfg.data.path, cfg.data.val_fraction = str(tmp_path), 0.5
    code = textwrap.dedent(moefold.data.__doc__.split("\n\n", 1)[1])
    scope = {"cfg": cfg, "S": 16, "B": 2, "seed": 0, "n": 3, **vars(moefold.data)}
    exec(compile(code, "moefold.data.__doc__", "exec"), scope)
    assert scope["train"].next_batch().input_ids_BS.shape == (2, 16)
    assert [b.input_ids_BS.shape for b in scope["val"]] == [(2, 16)] * 3


def test_token_files_in_a_tree_are_their_name_ordered_concatenation(tmp_path):
    """Naive reference: each file's ids as NumPy reads it, files in sorted relative-name order
    (a hard link once), the last val_fraction of tokens held out, windows of S+1 every S."""
    rng = np.random.default_rng(3)
    data = tmp_path / "data"
    (data / "b" / "c").mkdir(parents=True)
    arrays = {"a.npy": rng.integers(0, 257, 101).astype(np.uint16),
              "b/c/d.bin": rng.integers(0, 257, 77).astype(np.uint16),
              "b/e.npy": rng.integers(0, 257, 50).astype(np.int32),
              "b/c/f.npy": rng.integers(0, 257, 13).astype(np.int64)}
    for name, ids_N in arrays.items():
        (np.save if name.endswith(".npy") else lambda p, a: a.tofile(p))(data / name, ids_N)
    os.link(data / "b/e.npy", data / "z.npy")
    names = sorted(arrays)  # a.npy, b/c/d.bin, b/c/f.npy, b/e.npy
    stream = [int(t) for name in names for t in (np.load(data / name) if name.endswith(".npy")
                                                  else np.fromfile(data / name, np.uint16))]
    streams = streams_of(data, val_fraction=0.1)
    num_val = round(len(stream) * 0.1)
    assert streams.train_N.tolist() == stream[:-num_val]
    assert streams.val_N.tolist() == stream[-num_val:]
    sequences = PackedSequences(streams.train_N, 9)
    expected = [stream[i:i + 10] for i in range(0, len(stream) - num_val - 9, 9)]
    assert [sequences[i].tolist() for i in range(len(sequences))] == expected
