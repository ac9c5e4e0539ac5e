"""An audit of corpus._encode_shared's edges (after test_data_ranks_audit10), on 3 gloo ranks against
one process's build_token_streams (group None), byte for byte: more ranks than batches, a corpus of
one batch, empty documents, every document or none held out, 4-byte (uint32) ids, hundreds of
batches (as many async broadcasts outstanding), the first failure in corpus order when a rank fails
on an early batch after another failed on a later one; and a Trainer on 3 ranks resuming a
one-process run on a uint32 corpus (the data fingerprint check passes) and validating."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch.distributed as dist
from conftest import TINY_OVERRIDES, write_text_corpus
from ranks import run_ranks
from test_data_ranks_audit10 import _summary

from moefold.config import DataConfig, load_config
from moefold.data import corpus
from moefold.data.corpus import build_token_streams
from moefold.data.tokenizer import ByteTokenizer
from moefold.train import trainer as trainer_module

WORLD = 3


class WideBytes(ByteTokenizer):
    """The bytes spread over 70,001 ids (byte b is id 271 b + 3, EOS 70,000): streams of uint32,
    whose byte views and offsets are 4 bytes an id. `refused`: a byte it refuses (id -1)."""

    name, vocab_size, eos_id = "wide-bytes", 70_001, 70_000

    def __init__(self, refused: int | None = None):
        self.refused = refused

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        ids_per_text = []
        for bytes_N in super().encode_batch_np(texts):
            ids_N = bytes_N.astype(np.int64) * 271 + 3
            ids_N[bytes_N == self.refused] = -1
            ids_per_text.append(ids_N)
        return ids_per_text


def _corpus_of(root: Path, texts: Sequence[str]) -> str:
    if root.exists():
        return str(root)
    root.mkdir()
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(text)
    return str(root)


def _jsonl_with_empty_texts(root: Path) -> str:
    """30 records, every third text empty or null (skipped), beside a file of a type not read."""
    if not root.exists():
        root.mkdir()
        texts = [("" if i % 2 else None) if i % 3 == 0 else f"text {i} " * i for i in range(30)]
        (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        (root / "notes.md").write_text("not read")
    return str(root)


def _with_utf16(root: str, index: int) -> str:
    """The corpus with document `index` UTF-16, which reading it refuses (on every rank that gets there)."""
    if (Path(root) / f"doc{index:03d}.txt").read_bytes().startswith(b"\xff\xfe"):
        return root
    (Path(root) / f"doc{index:03d}.txt").write_bytes("\ufeffplain".encode("utf-16"))
    return root


def _cases(tmp_path: Path) -> dict[str, tuple[DataConfig, int, bool]]:
    """name: (data config, documents a batch, wide tokenizer). The corpora are written under
    `tmp_path` by the first call (the reference's, before the ranks start); later calls find them."""
    forty_dir = tmp_path / "forty"
    forty = str(forty_dir if forty_dir.exists() else write_text_corpus(forty_dir))
    many = _corpus_of(tmp_path / "many", [f"doc {i} " + "ab" * (i % 7) for i in range(300)])
    empties = _jsonl_with_empty_texts(tmp_path / "empties")
    refused = ["plain"] * 12
    refused[2] = refused[4] = "x\x01y"  # byte 1: refused by WideBytes(refused=1)
    return {
        "one batch over 3 ranks": (DataConfig(path=forty), 1024, False),
        "two batches over 3 ranks, uint32": (DataConfig(path=forty), 20, True),
        "uint32, 3-document batches": (DataConfig(path=forty), 3, True),
        "uint32, no validation": (DataConfig(path=forty, val_fraction=0.0), 3, True),
        "uint32, every document held out": (DataConfig(path=forty, val_fraction=0.9999), 3, True),
        "uint32, one document": (DataConfig(path=forty + "/doc07.txt", val_fraction=0.1), 3, True),
        "300 batches of one document": (DataConfig(path=many, val_fraction=0.3), 1, True),
        "empty documents": (DataConfig(path=empties, val_fraction=0.3), 2, True),
        "failures at batches 9 (read), 4 and 2 on ranks 0, 1, 2": (DataConfig(path=_with_utf16(_corpus_of(
            tmp_path / "refused", refused), 9), val_fraction=0.0), 1, True),
    }


def _tokenizer(wide: bool):
    return WideBytes(refused=1) if wide else ByteTokenizer()  # no corpus but "refused" holds byte 1


def _summaries(tmp_path: Path, group) -> dict[str, dict]:
    said, saved_batch = {}, corpus._ENCODE_BATCH
    try:
        for name, (data_cfg, batch, wide) in _cases(tmp_path).items():
            corpus._ENCODE_BATCH = batch
            said[name] = _summary(lambda: build_token_streams(data_cfg, _tokenizer(wide), group=group))
    finally:
        corpus._ENCODE_BATCH = saved_batch
    return said


def _cases_on_rank(rank: int, tmp_path: Path) -> None:
    dist.init_process_group("gloo")
    said = _summaries(tmp_path / "cases", dist.new_group(backend="gloo"))
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(said))


def test_every_rank_holds_one_processs_streams_at_the_edges(tmp_path):
    (tmp_path / "cases").mkdir()
    reference = _summaries(tmp_path / "cases", None)  # writes the corpora the ranks read
    run_ranks(WORLD, _cases_on_rank, tmp_path)
    assert reference["uint32, 3-document batches"]["dtype"] == "uint32"
    assert reference["uint32, every document held out"]["docs"] == [1, 39]
    assert sum(reference["empty documents"]["docs"]) == 20  # 10 of 30 skipped
    assert "doc002.txt" in reference["failures at batches 9 (read), 4 and 2 on ranks 0, 1, 2"]["error"]
    for rank in range(WORLD):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in reference:
            assert said[name] == reference[name], (rank, name)


# --------------------------------------------------------------------------- the Trainer


def _trainer(run_dir: Path, corpus_dir: Path, steps: int, resume: Path | None = None):
    """A tiny model's Trainer on WideBytes' uint32 streams (its caller patches build_tokenizer)."""
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus_dir), "train.steps": str(steps),
                             "train.val_every": "1", "train.warmup_steps": "0", "model.dim": "16",
                             "moe.expert_hidden": "16", "model.ffn_hidden": "16"})
    return trainer_module.Trainer(cfg, run_dir, resume, out=lambda line: None)


def _resume_on_rank(rank: int, tmp_path: Path) -> None:
    trainer_module.build_tokenizer = lambda name: WideBytes()  # this rank's process only
    corpus._ENCODE_BATCH = 3  # 14 batches of the 40 documents over the 3 ranks
    trainer = _trainer(tmp_path / "ranks", tmp_path / "corpus", 2, resume=tmp_path / "one")
    last = trainer.fit()  # the fingerprint check passed: the resume trains step 2 and validates
    (tmp_path / f"trainer{rank}.json").write_text(json.dumps(
        {"fingerprint": trainer._data_fingerprint, "val_loss": last["val_loss"]}))


def test_three_ranks_resume_a_one_process_run_on_the_same_uint32_streams(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "build_tokenizer", lambda name: WideBytes())
    write_text_corpus(tmp_path / "corpus")
    one = _trainer(tmp_path / "one", tmp_path / "corpus", 1)
    one.fit()
    run_ranks(WORLD, _resume_on_rank, tmp_path)
    said = [json.loads((tmp_path / f"trainer{rank}.json").read_text()) for rank in range(WORLD)]
    assert [s["fingerprint"] for s in said] == [one._data_fingerprint] * WORLD
    assert all(np.isfinite(s["val_loss"]) for s in said)


class CrashingBytes(ByteTokenizer):
    """A tokenizer that fails as a program does (not a refusal of the data): out of memory, a bug."""

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise RuntimeError("the tokenizer crashed")


def _fault_on_rank(rank: int, corpus_dir: Path, out: Path) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))  # a rank left waiting fails in 20 s
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    corpus._ENCODE_BATCH = 2  # 6 documents: batches 0, 2 on rank 0, 1 on rank 1
    try:
        build_token_streams(DataConfig(path=str(corpus_dir), val_fraction=0.0),
                            CrashingBytes() if rank == 1 else ByteTokenizer(), group=group)
        said = "built"
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        said = f"{type(e).__name__}: {e}"
    (out / f"rank{rank}.txt").write_text(said)


def test_a_fault_on_one_rank_stops_the_others_at_once(tmp_path):
    """A rank whose encoding failed with anything but a DataError left the exchange before it
    began, and the other ranks waited in it until gloo's timeout (30 minutes by default; a launcher
    that ends every rank when one fails hid it). Now the faulting rank raises its own error and
    every other rank one that names it."""
    from test_data_ranks_audit10 import _few_documents

    corpus_dir = _few_documents(tmp_path / "corpus", [f"document {i}\n" for i in range(6)])
    run_ranks(2, _fault_on_rank, corpus_dir, tmp_path)
    assert (tmp_path / "rank1.txt").read_text() == "RuntimeError: the tokenizer crashed"
    assert (tmp_path / "rank0.txt").read_text() == (
        f"RuntimeError: rank 1 of the ranks encoding {corpus_dir} failed at its batch 1: "
        "RuntimeError: the tokenizer crashed")
