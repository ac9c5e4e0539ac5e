"""What a run logs on gloo ranks against the same config in one process: every value of every
metrics.jsonl record (docs/metrics.md) where steps accumulate micro-batches, a log window holds
several steps, gradients are clipped and an MTP module adds its loss; and the throughput
figures recomputed by hand from docs/metrics.md's definitions on a clock that moves 1 s a step."""

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import write_text_corpus
from layouts import assert_records_close, logged_records
from layouts import config as layout_config
from ranks import run_ranks

from moefold.train.trainer import Trainer

# grad_accum 2, a window of 2 steps, every aux loss, validation at the windows' ends
WINDOWED = {"train.grad_accum": "2", "logging.log_every": "2", "train.steps": "4",
            "moe.aux_loss_coeff": "0.01", "moe.global_aux_loss_coeff": "0.1", "moe.z_loss_coeff": "0.01",
            "train.val_every": "2", "data.val_fraction": "0.2", "train.grad_clip": "0.05"}
# val_batches counts micro-batches of micro_batch_size sequences (4 in one process, 2 a data rank):
# the same 4 validation sequences either way
LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "dp2-zero1": {"data_parallel": "ddp"}}


def _fit_layouts(rank: int, corpus: Path, root: Path) -> None:
    for name, parallel in LAYOUTS.items():
        Trainer(layout_config("deepseek", corpus, dp=2, extra={**WINDOWED, "train.val_batches": "2"},
                              **parallel), root / name,
                out=lambda line: None).fit()


def test_every_logged_value_on_two_data_ranks_and_two_expert_ranks_is_one_process(tmp_path):
    """dp2 and ep2 under FSDP, and dp2 under ZeRO-1 (each rank half of every global micro-batch)
    log what one process logs for the same global batch: losses, mtp_loss, the pre-clip gradient
    norm, every aux loss and its per-layer list, load imbalance, entropy, val_loss over the same
    sequences (1e-4 relative).
    (A capacity limit is left out: each data rank applies it to its own tokens, as Megatron-Core
    does, so its drops depend on the layout.)"""
    corpus = write_text_corpus(tmp_path / "corpus")
    one_process = layout_config("deepseek", corpus, extra={**WINDOWED, "train.val_batches": "1"})
    Trainer(one_process, tmp_path / "one", out=lambda line: None).fit()
    run_ranks(2, _fit_layouts, corpus, tmp_path)
    one = logged_records(tmp_path / "one")
    assert any("val_loss" in r for r in one)
    assert [r["step"] for r in one if "loss" in r] == [2, 4]
    for name in LAYOUTS:
        got_records = logged_records(tmp_path / name)
        assert [sorted(r) for r in got_records] == [sorted(r) for r in one], name
        assert_records_close(got_records, one, name)


def _fit_on_a_fake_clock(rank: int, cfg, run_dir: Path, out: Path) -> None:
    """The run on a clock that moves 1 s per training step only; rank 0 saves its flops per token."""
    import moefold.train.trainer as trainer_module

    clock = [0.0]
    trainer_module.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    step = Trainer.train_step

    def timed_step(self):
        result = step(self)
        clock[0] += 1.0
        return result

    Trainer.train_step = timed_step
    trainer = Trainer(cfg, run_dir, out=lambda line: None)
    trainer.fit()
    if rank == 0:
        torch.save(trainer.flops_per_token, out)


@pytest.mark.parametrize("parallel", [{}, {"ep": 2}, {"tp": 2}], ids=["dp2", "ep2", "tp2"])
def test_throughput_on_two_ranks_is_the_jobs_tokens_and_each_devices_flops(tmp_path, parallel):
    """docs/metrics.md: tokens_per_s is the whole job's training tokens per second (global batch ·
    seq_len per step), tflops each device's share of their FLOPs (tokens_per_s / world · FLOPs per
    token), mfu tflops over logging.peak_tflops; with grad_accum 3 and MTP."""
    corpus = write_text_corpus(tmp_path / "corpus")
    dp = 1 if "tp" in parallel else 2
    cfg = layout_config("deepseek", corpus, dp=dp, steps=2,
                        extra={"train.grad_accum": "3", "logging.log_every": "1", "logging.peak_tflops": "1e-4"},
                        **parallel)
    run_ranks(2, _fit_on_a_fake_clock, cfg, tmp_path / "run", tmp_path / "flops.pt")
    flops_per_token = torch.load(tmp_path / "flops.pt")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = 3 * 4 * cfg.train.seq_len  # grad_accum · global micro-batch (4) · seq_len
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step, rel=1e-12)
        assert r["tflops"] == pytest.approx(tokens_per_step / 2 * flops_per_token / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 1e-4, rel=1e-12)
