"""Audit of the data path (tenth pass): the step's read-ahead (train/step_data.py) against the reads a
run needs, counted on the loader; the batch's copy to the device (`Trainer._to_device`)."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest
import torch

from moefold.config import load_config
from moefold.data.loader import Batch, make_batch
from moefold.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import TINY_OVERRIDES  # noqa: E402


def _counting_reads(trainer: Trainer) -> list[int]:
    """Wraps the trainer's loader: the list gets, for each batch read, the steps done when it was read."""
    read_at: list[int] = []
    loader, next_batch = trainer.train_loader, trainer.train_loader.next_batch

    def counted():
        read_at.append(trainer.step)
        return next_batch()

    loader.next_batch = counted
    return read_at


@pytest.mark.parametrize("steps,accum", [(1, 1), (3, 1), (3, 2)])
def test_a_run_reads_the_batches_of_its_steps_each_read_during_the_step_before(tmp_path, text_corpus,
                                                                                steps, accum):
    """A run of `steps` reads steps · accum batches: the first step's when it starts, every later
    step's during the one before (the read-ahead's overlap), none past train.steps."""
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": str(steps),
                             "train.grad_accum": str(accum), "train.warmup_steps": "0",
                             "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    read_at = _counting_reads(trainer)
    trainer.fit()
    assert read_at == [0] * accum + [step for step in range(steps - 1) for _ in range(accum)]


def test_bench_reads_each_step_ahead_whatever_train_steps_says(tmp_path):
    """`moefold bench` counts its steps itself (its trainer's `step` stays 0): with train.steps=1 its
    steps still read the next one's batch during the one before, as a training's do."""
    from moefold.bench.run import BenchTrainer

    cfg = load_config(None, {**TINY_OVERRIDES, "train.steps": "1", "train.warmup_steps": "0"})
    trainer = BenchTrainer(cfg, tmp_path / "no-run", out=lambda line: None)
    events: list[str] = []
    next_batch, optimizer_step = trainer.train_loader.next_batch, trainer.optimizer_step
    trainer.train_loader.next_batch = lambda: events.append("read") or next_batch()
    trainer.optimizer_step = lambda: events.append("step") or optimizer_step()
    for _ in range(2):
        trainer.train_step()
    assert events == ["read", "read", "step", "read", "step"]


def _batches(count: int, rows: int = 8, seq_len: int = 4096) -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    return [make_batch(torch.randint(0, 50_000, (rows, seq_len + 1), generator=generator), 0)
            for _ in range(count)]


def test_a_batch_on_the_cpu_is_the_loader_rows_unpinned():
    """On a CPU run `_to_device` pins nothing (pinning needs CUDA: a CPU-only torch raises) and
    gives the batch's own values."""
    batch = _batches(1, rows=2, seq_len=16)[0]
    input_ids_BS, labels_BS = Trainer._to_device(types.SimpleNamespace(device=torch.device("cpu")), batch)
    assert torch.equal(input_ids_BS, batch.input_ids_BS) and torch.equal(labels_BS, batch.labels_BS)
    assert not input_ids_BS.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host-to-CUDA copy")
def test_batches_copied_to_cuda_queue_behind_busy_kernels_without_waiting_and_arrive_intact():
    """Three batches copied while the stream sleeps ~1 s: the host returns at once (a copy from
    pageable memory may wait for the stream), and each batch arrives with its own rows although
    their pinned blocks were dropped before the copies ran (the caching host allocator must not
    hand one to the next batch early)."""
    trainer = types.SimpleNamespace(device=torch.device("cuda"))
    batches = _batches(3)
    Trainer._to_device(trainer, batches[0])  # the pinned allocator's first blocks, outside the timing
    torch.cuda.synchronize()
    torch.cuda._sleep(1_500_000_000)  # cycles: ~1 s at 1.5 GHz
    start = time.perf_counter()
    copies = [Trainer._to_device(trainer, batch) for batch in batches]
    host_s = time.perf_counter() - start
    torch.cuda.synchronize()
    assert host_s < 0.2, f"the host waited {host_s:.3f} s for the stream"
    for batch, (input_ids_BS, labels_BS) in zip(batches, copies):
        assert torch.equal(input_ids_BS.cpu(), batch.input_ids_BS)
        assert torch.equal(labels_BS.cpu(), batch.labels_BS)
