"""An audit of the read-ahead that stops at train.steps (Trainer._another_step_follows, 3e4195d +
28e48ea): each real step still trains on its own micro-batches. A run of 4 steps with grad_accum 2,
validation and a checkpoint every 2 steps logs the losses of the same run reading ahead after every
step (the behaviour before) and of that run resumed: from its mid-run checkpoint (saved with the next
step read ahead) and from a run of 2 steps (its last step read nothing ahead) continued to 4."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from moefold.config import load_config
from moefold.train.trainer import Trainer, TrainingInterrupted

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TINY_OVERRIDES  # noqa: E402


def _fit(run_dir: Path, corpus: Path, steps: int, resume: Path | None = None,
         read_ahead_always: bool = False, stop_in_step: int | None = None) -> list[dict]:
    """The run's train and validation records of metrics.jsonl, in order, without timings.
    `stop_in_step`: a SIGTERM arrives during that step (the run stops after it, saved)."""
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": str(steps),
                             "train.grad_accum": "2", "train.val_every": "2", "checkpoint.every": "2",
                             "checkpoint.keep": "4"})
    trainer = Trainer(cfg, run_dir, resume, out=lambda line: None)
    if read_ahead_always:  # as before 3e4195d: the last step reads one step ahead too
        trainer._another_step_follows = lambda: True
    if stop_in_step is None:
        trainer.fit()
    else:
        _signal_in_step(trainer, stop_in_step)
        with pytest.raises(TrainingInterrupted, match=f"at step {stop_in_step};"):
            trainer.fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: record[key] for key in ("step", "loss", "val_loss") if key in record}
            for record in records if "loss" in record or "val_loss" in record]


def _signal_in_step(trainer: Trainer, step: int) -> None:
    train_step = trainer.train_step

    def signalled_step():
        if trainer.step + 1 == step:
            trainer._stop_signal = signal.SIGTERM  # as the handler records it
        return train_step()

    trainer.train_step = signalled_step


def test_each_step_trains_on_its_batches_read_ahead_or_not_in_one_go_or_resumed(tmp_path, text_corpus):
    reading_ahead_always = _fit(tmp_path / "always", text_corpus, 4, read_ahead_always=True)
    one_go = _fit(tmp_path / "one", text_corpus, 4)
    assert [r["step"] for r in one_go if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in one_go if "val_loss" in r] == [2, 4]
    assert one_go == reading_ahead_always
    # From step 2 of the 4-step run (saved with step 3's batches read ahead).
    mid_run = _fit(tmp_path / "mid", text_corpus, 4, resume=tmp_path / "one" / "checkpoints" / "step_00000002")
    assert mid_run == [r for r in one_go if r["step"] > 2]
    # A run of 2 steps (step 2 read nothing ahead; saved at its end), then continued to 4.
    first_half = _fit(tmp_path / "half", text_corpus, 2)
    continued = _fit(tmp_path / "half", text_corpus, 4, resume=tmp_path / "half")
    assert first_half == [r for r in one_go if r["step"] <= 2]
    assert continued == one_go
    # Stopped by a signal in step 3 (saved with step 4 read ahead), then resumed.
    _fit(tmp_path / "stopped", text_corpus, 4, stop_in_step=3)
    resumed = _fit(tmp_path / "stopped", text_corpus, 4, resume=tmp_path / "stopped")
    assert resumed == one_go
