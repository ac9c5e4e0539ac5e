"""An audit of a run stopped by a signal (SIGTERM) while the trainer reads the next step's micro-batches
ahead (train/step_data.StepBatches, Trainer._another_step_follows): the stop's checkpoint holds the
data position after the steps trained, not after the read-ahead, so the resumed run trains the rows an
uninterrupted run trains next, with its losses (the reference: that run, in one process). One process
stops after the step the signal arrived in; 2 gloo ranks, the signal to one, after the step their vote
is read at (train/stop.py). The signal is sent by the process to itself (the trainer's own handler),
before the step's first micro-batch or in its optimizer step (after the read-ahead). The stopped run
reads nothing past its last step where the stop is known before the read-ahead: one process signalled
before it, and ranks always (the vote the step's end reads was started a step before)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from moefold.config import load_config
from moefold.train.stop import StopVote
from moefold.train.trainer import Trainer, TrainingInterrupted

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TINY_OVERRIDES  # noqa: E402
from ranks import run_ranks  # noqa: E402

STEPS, ACCUM, SIGNAL_STEP = 6, 2, 3
MOMENTS = ["before the read-ahead", "after the read-ahead"]


def _config(corpus: Path, micro_batch_size: int, checkpoint_every: int):
    return load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": str(STEPS),
                              "train.grad_accum": str(ACCUM), "train.micro_batch_size": str(micro_batch_size),
                              "data.val_fraction": "0", "checkpoint.every": str(checkpoint_every)})


def _signal_in_step(trainer: Trainer, step: int, moment: str) -> None:
    """SIGTERM to this process in step `step`: as it starts, or in its optimizer step."""
    name = "train_step" if moment == "before the read-ahead" else "optimizer_step"
    method = getattr(trainer, name)

    def signalled(*args):
        if trainer.step + 1 == step:  # `step` counts the steps done before this one
            os.kill(os.getpid(), signal.SIGTERM)
        return method(*args)

    setattr(trainer, name, signalled)


def _recorded_fit(trainer: Trainer) -> dict:
    """Fits `trainer`; the ids of every micro-batch its loader read and of every one it trained
    on (this rank's rows), the step it stopped at (None: it ran to the end) and the collectives
    started on the ranks' gloo group (the stop and data votes)."""
    read, trained, votes = [], [], []
    next_batch, next_step = trainer.train_loader.next_batch, trainer.step_batches.next_step

    def recorded_batch():
        batch = next_batch()
        read.append(batch.input_ids_BS.tolist())
        return batch

    def recorded_step():
        batches = next_step()
        trained.extend(batch.input_ids_BS.tolist() for batch in batches)
        return batches

    all_reduce = dist.all_reduce  # train/stop.py and step_data.py call it through the module

    def recorded_all_reduce(tensor, *args, group=None, **kwargs):
        if trainer._stop_vote is not None and group is trainer._stop_vote.group:
            votes.append(trainer.step)
        return all_reduce(tensor, *args, group=group, **kwargs)

    trainer.train_loader.next_batch, trainer.step_batches.next_step = recorded_batch, recorded_step
    dist.all_reduce = recorded_all_reduce
    try:
        trainer.fit()
        stopped = None
    except TrainingInterrupted:
        stopped = trainer.step
    finally:
        dist.all_reduce = all_reduce
    return {"read": read, "trained": trained, "stopped": stopped, "votes": len(votes)}


def _fit(run_dir: Path, corpus: Path, micro_batch_size: int, resume: Path | None = None,
         moment: str | None = None, signalled: bool = True, checkpoint_every: int = 0) -> dict:
    trainer = Trainer(_config(corpus, micro_batch_size, checkpoint_every), run_dir, resume, out=lambda line: None)
    if moment is not None and signalled:
        _signal_in_step(trainer, SIGNAL_STEP, moment)
    return _recorded_fit(trainer)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _read_past_the_last_step(run: dict) -> int:
    return len(run["read"]) - len(run["trained"])


@pytest.mark.parametrize("moment", MOMENTS)
def test_one_process_stopped_by_a_signal_resumes_with_the_uninterrupted_runs_batches(tmp_path, text_corpus,
                                                                                    moment):
    reference = _fit(tmp_path / "reference", text_corpus, 4)
    assert (reference["stopped"], len(reference["trained"]), _read_past_the_last_step(reference)) == (
        None, STEPS * ACCUM, 0)
    stopped = _fit(tmp_path / "run", text_corpus, 4, moment=moment)
    assert stopped["stopped"] == SIGNAL_STEP  # after the step the signal arrived in
    resumed = _fit(tmp_path / "run", text_corpus, 4, resume=tmp_path / "run")
    assert stopped["trained"] + resumed["trained"] == reference["trained"]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")
    assert _read_past_the_last_step(resumed) == 0
    # Known before the read-ahead: nothing read past step 3. After it: step 4's rows, never trained.
    assert _read_past_the_last_step(stopped) == (0 if moment == "before the read-ahead" else ACCUM)


def _stop_and_resume_on_rank(rank: int, corpus: Path, run_dir: Path, moment: str, checkpoint_every: int) -> None:
    """2 data ranks of 2 sequences each (the one process's micro-batch of 4); the signal to rank 1 only."""
    stopped = _fit(run_dir, corpus, 2, moment=moment, signalled=rank == 1, checkpoint_every=checkpoint_every)
    dist.barrier()  # rank 0's run has let go of the run directory: a relaunch starts after every rank ended
    resumed = _fit(run_dir, corpus, 2, resume=run_dir, checkpoint_every=checkpoint_every)
    (run_dir.parent / f"rank{rank}.json").write_text(json.dumps({"stopped": stopped, "resumed": resumed}))


# (the moment in step 3, checkpoint.every, the step the ranks stop at, micro-batches read past it,
# votes started in the stopped and the resumed run)
RANK_CASES = {
    # The vote started at step 3's end is read at step 4's, and known within it: both ranks stop
    # there, together, having read nothing ahead. No collective added: one stop vote at each boundary
    # until the stop is read (steps 1-3; 5-6), one data vote with each step's reads (steps 1-4; 5-6):
    # the first step's own, then each read ahead. Before, step 4 read step 5's ahead: 8 votes.
    "before": ("before the read-ahead", 0, SIGNAL_STEP + 1, 0, [7, 4]),
    "after": ("after the read-ahead", 0, SIGNAL_STEP + 1, 0, [7, 4]),
    # Step 3 saves: the ranks vote at once at its end, known only after step 4 was read ahead, which
    # the checkpoint's position leaves out. Stop votes at steps 1-3; 4-6, data votes at steps 1-4; 4-6.
    "saving step": ("before the read-ahead", SIGNAL_STEP, SIGNAL_STEP, ACCUM, [7, 6]),
}


@pytest.mark.parametrize("case", RANK_CASES)
def test_ranks_stopped_by_a_signal_to_one_read_nothing_past_their_last_step(tmp_path, text_corpus, case):
    moment, checkpoint_every, stop, read_past, votes = RANK_CASES[case]
    reference = _fit(tmp_path / "reference", text_corpus, 4)
    run_ranks(2, _stop_and_resume_on_rank, text_corpus, tmp_path / "run", moment, checkpoint_every)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert (rank["stopped"]["stopped"], rank["resumed"]["stopped"]) == (stop, None)
    # Each micro-batch's rows over the two data ranks are the one process's micro-batch.
    trained = [ranks[r]["stopped"]["trained"] + ranks[r]["resumed"]["trained"] for r in range(2)]
    assert [rows0 + rows1 for rows0, rows1 in zip(*trained, strict=True)] == reference["trained"]
    losses, reference_losses = _losses(tmp_path / "run"), _losses(tmp_path / "reference")
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    assert [loss for _, loss in losses] == pytest.approx([loss for _, loss in reference_losses], rel=1e-5)
    assert [rank[run]["votes"] for rank in ranks for run in ("stopped", "resumed")] == votes * 2
    assert [_read_past_the_last_step(rank[run]) for rank in ranks for run in ("stopped", "resumed")] == [
        read_past, 0] * 2


# Per step boundary: (rank 0's signal, rank 1's signal, read at once), as test_stop_vote's.
BOUNDARIES = [(None, None, False), (None, signal.SIGINT, False), (None, None, False),
              (signal.SIGTERM, signal.SIGINT, True)]


def _settled_then_agreed_on_rank(rank: int, out: Path) -> None:
    dist.init_process_group("gloo")
    vote = StopVote()
    read = [(vote.settled(), vote.settled(), vote.agreed(signals[rank], now=now)) for *signals, now in BOUNDARIES]
    (out / f"rank{rank}.json").write_text(json.dumps(read))


def test_the_vote_settled_mid_step_is_what_the_boundary_reads_on_every_rank(tmp_path):
    """`settled` (twice: the trainer asks once a step) reads the vote started at the boundary before,
    which `agreed` then returns; a vote read at once (a save, the last step) is not known before."""
    run_ranks(2, _settled_then_agreed_on_rank, tmp_path)
    expected = [[None, None, None], [None, None, None], [signal.SIGINT, signal.SIGINT, signal.SIGINT],
                [None, None, signal.SIGTERM]]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [expected, expected]
