"""Audit of the data path (tenth pass): the step's read-ahead (train/step_data.py) against the reads a
run needs, counted on the loader; the batch's copy to the device (`Trainer._to_device`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moefold.config import load_config
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
