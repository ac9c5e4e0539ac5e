"""The same config in one process and on gloo ranks: the validation set's sequences, and the note a
resume on another number of data ranks prints about its global batch."""

from pathlib import Path

import torch
from conftest import write_text_corpus
from layouts import config as layout_config
from ranks import run_ranks

from moefold.train.trainer import Trainer

# 2 sequences per data rank, 3 micro-batches of validation: one process validates 6 sequences.
VALIDATION = {"train.micro_batch_size": "2", "data.val_fraction": "0.3", "train.val_batches": "3",
              "train.steps": "2", "train.warmup_steps": "0", "checkpoint.save_at_end": "true"}
LAYOUTS = {"dp2": {}, "ep2-allgather": {"ep": 2, "ep_dispatcher": "allgather"}}


def _config(corpus: Path, **parallel):
    return layout_config("qwen3", corpus, extra=VALIDATION, **parallel)


def _on_rank(rank: int, corpus: Path, root: Path, out: Path) -> None:
    results = {}
    for name, parallel in LAYOUTS.items():
        trainer = Trainer(_config(corpus, **parallel), root / name, out=lambda line: None)
        # Each data rank holds only its rows: the sequences validated are the data ranks' sum.
        held = torch.tensor([sum(b.input_ids_BS.shape[0] for b in trainer.val_batches)])
        results[name] = {"val_loss": trainer.validate(), "sequences": int(trainer.dist.sum_over_data(held))}
    lines = []
    resumed = Trainer(_config(corpus), root / "resumed", resume=root / "one", out=lines.append)
    resumed._announce()
    results["notes"] = [line for line in lines if line.startswith("note: ")]
    if rank == 0:
        torch.save(results, out)


def test_validation_and_a_resume_on_two_data_ranks_against_one_process(tmp_path):
    """train.val_batches counted micro-batches of every data rank: the same config validated 6
    sequences in one process and 12 on two data ranks (val_batches · micro_batch_size · dp), so
    its val_loss was measured over other sequences on each layout (5.5765 against 5.5823 here) and
    was not comparable. It now counts micro-batches of train.micro_batch_size sequences, shared by
    the data ranks: the same 6 sequences, and one process's val_loss, under dp2 and under ep2 with
    the all-gather dispatcher (the uneven last batch padded). A checkpoint of the one-process run
    resumed on the two ranks says that its global batch went from 2 sequences to 4."""
    corpus = write_text_corpus(tmp_path / "corpus")
    one = Trainer(_config(corpus), tmp_path / "one", out=lambda line: None)
    one.fit()
    reference = Trainer(_config(corpus), tmp_path / "reference", out=lambda line: None)
    want = reference.validate()
    assert sum(b.input_ids_BS.shape[0] for b in reference.val_batches) == 6
    out = tmp_path / "results.pt"
    run_ranks(2, _on_rank, corpus, tmp_path, out)
    results = torch.load(out)
    for name in LAYOUTS:
        assert results[name]["sequences"] == 6, name
        torch.testing.assert_close(results[name]["val_loss"], want, rtol=1e-5, atol=0, msg=name)
    assert results["notes"] == [
        "note: the checkpoint's run trained 2 sequences (32 tokens) per optimizer step, this run trains 4 "
        "(64 tokens): train.micro_batch_size · data-parallel ranks · grad_accum = 2 · 2 · 1; "
        "train.global_batch_size=2 keeps the saved one"]
