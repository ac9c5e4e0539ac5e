"""Audit of moefold.data against naive references: inputs that reached the user as tracebacks
(file names that are not UTF-8, pathological JSON lines, odd .npy dtypes)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from data_reading import BYTES, deny_read, streams_of

from moefold.errors import DataError

def byte_doc(raw: bytes) -> list[int]:
    """Naive reference: a document's bytes followed by EOS."""
    return list(raw) + [BYTES.eos_id]


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


# ---------------------------------------------------------------------------------------------
# The trainer's data order across layouts
# ---------------------------------------------------------------------------------------------


def trainer_loader(corpus: Path, dp: int, micro_batch: int, **train):
    """The train loaders Trainer._build_data builds on each data rank of `dp` (the rest of the
    trainer stubbed: it reads only cfg, dist.dp_size, dist.dp_rank, grad_accum and _stop_vote, whose
    group shares the encoding over the ranks: None, each encodes alone), and the micro-batches of a step."""
    from types import SimpleNamespace

    from moefold.config import load_config, micro_batches_per_step
    from moefold.train.trainer import Trainer

    cfg = load_config("tiny-qwen3", {
        "data.path": str(corpus), "data.val_fraction": "0", "train.seq_len": "64",
        "train.micro_batch_size": str(micro_batch),
        **{f"train.{key}": str(value) for key, value in train.items()}})
    loaders = []
    for rank in range(dp):
        stub = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(dp_size=dp, dp_rank=rank),
                               grad_accum=micro_batches_per_step(cfg.train, dp), _stop_vote=None)
        Trainer._build_data(stub)
        loaders.append(stub.train_loader)
    return loaders, stub.grad_accum


def step_windows(loaders, accum: int, steps: int) -> list[list[tuple[int, ...]]]:
    """Each step's sequences (as token tuples), in the order the global batch holds them: each
    micro-batch's rows data rank by data rank."""
    return [[tuple(row) for _ in range(accum) for loader in loaders
             for row in loader.next_batch().input_ids_BS.tolist()] for _ in range(steps)]


@pytest.mark.parametrize("layout, one_process", [
    # (dp, micro_batch_size, train.*) on dp ranks, and one process with the same global batch
    ((2, 2, {"global_batch_size": 4}), (1, 2, {"global_batch_size": 4})),
    ((3, 1, {"global_batch_size": 6}), (1, 1, {"global_batch_size": 6})),
    ((2, 1, {"grad_accum": 2}), (1, 1, {"grad_accum": 4})),
])
def test_each_step_trains_on_the_sequences_of_one_process_past_an_epoch(tmp_path, layout,
                                                                         one_process):
    """parallel.md: "a layout trains on exactly the data one process does". The loader dropped
    each epoch's last partial global micro-batch (micro_batch_size · dp sequences), so on dp ranks
    an epoch ended at another sequence than in one process with the same global batch: every
    step after the first epoch trained on other sequences. An epoch now ends at its last whole
    optimizer step, however that step is split into micro-batches and ranks."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: " + "x" * (i % 7) + "\n" for i in range(150)))
    loader, accum = trainer_loader(corpus, *layout[:2], **layout[2])
    ref_loader, ref_accum = trainer_loader(corpus, *one_process[:2], **one_process[2])
    global_batch = loader[0].batch_size * accum
    assert ref_loader[0].batch_size * ref_accum == global_batch
    num_sequences = len(loader[0].sequences)
    # Precondition: the micro-batches leave different remainders of an epoch.
    assert num_sequences % loader[0].batch_size != num_sequences % ref_loader[0].batch_size
    steps = 2 * num_sequences // global_batch + 3  # past two epoch ends
    assert step_windows(loader, accum, steps) == step_windows(ref_loader, ref_accum, steps)


@pytest.mark.parametrize("saved, resumed", [
    ((2, 2, {"global_batch_size": 8}), (1, 2, {"global_batch_size": 8})),  # world 2 → 1
    ((1, 1, {"grad_accum": 6}), (3, 2, {"grad_accum": 1})),                # world 1 → 3
])
def test_a_resume_under_another_layout_continues_the_uninterrupted_steps(tmp_path, saved, resumed):
    """A checkpoint's data position, resumed on another number of data ranks with the same global
    batch, at every step of two epochs (mid-epoch, at and past the epoch's end)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: " + "y" * (i % 5) + "\n" for i in range(120)))
    reference, accum = trainer_loader(corpus, *saved[:2], **saved[2])
    num_steps = 2 * len(reference[0].sequences) // (reference[0].batch_size * accum) + 2
    expected = step_windows(reference, accum, num_steps)
    for stop in range(num_steps):
        original, _ = trainer_loader(corpus, *saved[:2], **saved[2])
        step_windows(original, accum, stop)
        loader, resumed_accum = trainer_loader(corpus, *resumed[:2], **resumed[2])
        for rank_loader in loader:
            rank_loader.load_state_dict(original[0].state_dict())
        assert step_windows(loader, resumed_accum, num_steps - stop) == expected[stop:], stop


@pytest.mark.parametrize("dp, micro_batch, accum", [(2, 3, 1), (3, 2, 2), (4, 1, 3)])
def test_data_ranks_take_disjoint_rows_that_cover_the_seeded_epoch(tmp_path, dp, micro_batch,
                                                                   accum):
    """Each data rank's rows (its own loader's) against a naive reference: the ranks' rows of a
    micro-batch are disjoint and together the global micro-batch, and one epoch visits, in the
    seeded order, every sequence once up to its last whole step (the sequence count divides by
    neither dp · micro_batch_size nor the step)."""
    import torch

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"row {i}\n" for i in range(300)))
    loaders = trainer_loader(corpus, dp, micro_batch, grad_accum=accum)[0]
    num_sequences, step = len(loaders[0].sequences), dp * micro_batch * accum
    assert num_sequences % (dp * micro_batch) and num_sequences % step  # a remainder to drop
    windows = [tuple(loaders[0].sequences[i][:-1].tolist()) for i in range(num_sequences)]
    index_of = {window: i for i, window in enumerate(windows)}
    assert len(index_of) == num_sequences  # every sequence tells which it is
    seen = []
    for _ in range(num_sequences // step * accum):  # one epoch of micro-batches
        rows = []
        for loader in loaders:
            local = loader.next_batch()
            assert local.input_ids_BS.shape[0] == micro_batch
            assert torch.equal(local.labels_BS[:, :-1], local.input_ids_BS[:, 1:])
            rows += [index_of[tuple(row)] for row in local.input_ids_BS.tolist()]
        seen += rows
    orders = [torch.randperm(num_sequences, generator=torch.Generator().manual_seed(
        loaders[0].seed * 1_000_003 + epoch)).tolist() for epoch in range(2)]
    assert seen == orders[0][:num_sequences - num_sequences % step]
    assert len(set(seen)) == len(seen)
    next_rows = [index_of[tuple(row)] for loader in loaders for row in loader.next_batch().input_ids_BS.tolist()]
    assert next_rows == orders[1][:dp * micro_batch]  # the remainder dropped, the next epoch begun


def deny_stat(monkeypatch, path: Path) -> None:
    """stat(`path`) fails as under a directory without search (x) permission (tests may run as
    root, which no permission stops)."""
    import errno

    real_stat = os.stat

    def guarded_stat(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_stat(file, *args, **kwargs)

    monkeypatch.setattr(os, "stat", guarded_stat)


@pytest.mark.parametrize("target", ["data.path", "a file in it"])
def test_a_path_that_cannot_be_stated_is_a_one_line_error(tmp_path, monkeypatch, target):
    """data.path=/home/alice/corpus.txt for another user (/home/alice 0750): Path.exists() raises
    PermissionError rather than returning False, and it reached the user as a traceback."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "b.txt").write_text("text")
    data_path = tmp_path / "data" / ("sub/b.txt" if target == "data.path" else "")
    deny_stat(monkeypatch, tmp_path / "data" / "sub" / "b.txt")
    where = "" if target == "data.path" else "sub/b.txt: "
    with pytest.raises(DataError) as info:
        streams_of(data_path)
    assert str(info.value) == f"data.path={data_path}: {where}cannot be read (Permission denied)"


def test_a_tokenizer_that_cannot_be_stated_or_read_is_a_one_line_error(tmp_path, monkeypatch):
    """data.tokenizer under a directory without search permission (Path.is_dir() raised), and a
    tokenizer_config.json beside it that cannot be read: PermissionError tracebacks."""
    from tokenizers import Tokenizer, models

    from moefold.data import build_tokenizer

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "</t>": 1}, unk_token="[UNK]"))
    tokenizer.save(str(path := tmp_path / "tokenizer.json"))
    (config := tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</t>"}')
    assert build_tokenizer(str(path)).eos_id == 1  # precondition: readable, it loads
    with monkeypatch.context() as patch:
        deny_stat(patch, path)
        with pytest.raises(DataError) as info:
            build_tokenizer(str(path))
        assert str(info.value) == f"data.tokenizer={path}: cannot be read (Permission denied)"
    deny_read(monkeypatch, config)
    with pytest.raises(DataError) as info:
        build_tokenizer(str(path))
    assert str(info.value) == (f"data.tokenizer={path}: {config}: cannot be read "
                               "(Permission denied)")
