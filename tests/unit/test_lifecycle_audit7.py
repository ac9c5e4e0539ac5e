"""The training lifecycle against one uninterrupted run: a run stopped part-way (a crash between
checkpoints, a signal, a failed save) and resumed must end with the uninterrupted run's records,
checkpoints and states."""

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import TINY_OVERRIDES, metrics_records
from moefold.config import load_config
from moefold.train.trainer import Trainer, TrainingInterrupted

def _config(corpus: Path, **overrides: str):
    return load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), **overrides})


def _train(cfg, run: Path, resume: Path | None = None) -> Trainer:
    trainer = Trainer(cfg, run, resume=resume, out=lambda line: None)
    trainer.fit()
    return trainer


class _Crash(Exception):
    """A failure in the middle of training (an out-of-memory error, a lost node)."""


def _crashing_in_step(monkeypatch, step: int) -> None:
    """Trainer.train_step raises as it starts step `step` (1-based)."""
    train_step = Trainer.train_step

    def crashing(self):
        if self.step + 1 == step:
            raise _Crash(f"crash in step {step}")
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", crashing)


# log every 4, save every 3: the checkpoint at 6 falls inside the log window 5–8.
BETWEEN_LOG_STEPS = {"train.steps": "8", "logging.log_every": "4", "checkpoint.every": "3", "train.grad_accum": "2"}


def test_a_crash_after_a_checkpoint_between_log_steps_resumes_to_the_uninterrupted_runs_records(
        tmp_path, text_corpus, monkeypatch):
    """Crashed in step 7 of 8, after the checkpoint of step 6 and the log of step 4, and resumed:
    steps 5 and 6 were in no record (the window they were in died with the process, and the
    resumed run's window starts at 7), and the resumed step-8 record averaged steps 7–8 where
    the uninterrupted run's averaged 5–8. Every record must be the uninterrupted run's, and every
    step in one record (the means of a run that logs every step, over the steps each covers)."""
    cfg = _config(text_corpus, **BETWEEN_LOG_STEPS)
    whole = tmp_path / "whole"
    _train(cfg, whole)
    every_step = tmp_path / "every_step"
    _train(_config(text_corpus, **{**BETWEEN_LOG_STEPS, "logging.log_every": "1"}), every_step)
    losses = {r["step"]: r["loss"] for r in metrics_records(every_step) if "loss" in r}

    run = tmp_path / "run"
    _crashing_in_step(monkeypatch, 7)
    with pytest.raises(_Crash):
        _train(cfg, run)
    monkeypatch.undo()
    _train(cfg, run, resume=run)

    assert metrics_records(run) == metrics_records(whole)
    logged = [r["step"] for r in metrics_records(run) if "loss" in r]
    assert logged[-1] == 8
    for first, last in zip([0, *logged], logged):
        record = next(r for r in metrics_records(run) if r["step"] == last and "loss" in r)
        window = [losses[s] for s in range(first + 1, last + 1)]
        assert record["loss"] == pytest.approx(sum(window) / len(window), rel=1e-6), (first, last)


def test_a_signal_during_a_save_between_log_steps_keeps_its_window_in_the_expert_load_history(
        tmp_path, text_corpus, monkeypatch):
    """SIGTERM during the save of step 6 (log every 4): the stop logged steps 5–6 after the
    checkpoint was written, so their expert-load window was in metrics.jsonl but not in the
    checkpoint's heatmap history; the resumed run's heatmap lacked it. Resumed, the history must
    be the uninterrupted run's, one window per record of metrics.jsonl."""
    import moefold.checkpoint.dcp as checkpoint

    cfg = _config(text_corpus, **BETWEEN_LOG_STEPS)
    whole = _train(cfg, tmp_path / "whole")
    save = checkpoint.dcp.save

    def signalled_at_step_6(state, checkpoint_id):
        if state["step"] == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", signalled_at_step_6)
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted):
        _train(cfg, run)
    monkeypatch.undo()
    resumed = _train(cfg, run, resume=run)

    assert resumed.load_history == whole.load_history
    assert [step for step, _ in resumed.load_history] == [r["step"] for r in metrics_records(run) if "loss" in r]
    assert metrics_records(run) == metrics_records(tmp_path / "whole")


def test_a_checkpoint_is_flushed_to_disk_before_its_rename_and_its_directory_after(tmp_path, durability_events):
    """DCP fsyncs each shard and `.metadata`, but `.metadata` gets its name by a rename inside the
    `.tmp` directory that nothing flushed: after a power cut, `step_N` could be on disk without its
    `.metadata` entry (ext4 and XFS may write one rename before another directory's entries), so
    not complete, while the rotation had deleted the checkpoint before it: no checkpoint left. The
    directory's entries are flushed before it is renamed, and the rename after, as files.py does
    for files."""
    import torch

    from moefold.checkpoint.dcp import checkpoint_path, save_checkpoint

    run = tmp_path.resolve() / "run"  # as /proc/self/fd names the files
    save_checkpoint({"model": {"w": torch.ones(3)}, "step": 1}, run, 1, keep=1)
    final = checkpoint_path(run, 1)
    tmp = final.with_name(final.name + ".tmp")
    renamed = durability_events.index(("replace", tmp, final))
    assert durability_events[renamed - 1:renamed + 2] == [("fsync", tmp), ("replace", tmp, final),
                                                          ("fsync", final.parent)]


def test_the_records_of_a_checkpoints_steps_are_on_disk_before_it(tmp_path, text_corpus, durability_events):
    """metrics.jsonl is written unflushed (each record reaches the page cache): a power cut could
    keep a checkpoint (flushed) and lose the records of the steps before it, which the run resumed
    from it never logs again. The records are flushed before each checkpoint is renamed into place."""
    run = tmp_path.resolve() / "run"  # as /proc/self/fd names the files
    _train(_config(text_corpus, **{"train.steps": "4", "checkpoint.every": "2"}), run)
    for step in (2, 4):
        checkpoint = run / "checkpoints" / f"step_{step:08d}"
        renamed = durability_events.index(("replace", checkpoint.with_name(checkpoint.name + ".tmp"), checkpoint))
        previous = [e for e in durability_events[:renamed] if e[0] == "replace"][-1:]
        since = durability_events[durability_events.index(previous[0]) if previous else 0:renamed]
        assert ("fsync", run / "metrics.jsonl") in since, step


def test_superseded_records_are_in_a_named_file_on_disk_before_they_leave_metrics_jsonl(tmp_path, durability_events):
    """The records a resumed run logs again move to metrics.superseded.jsonl, flushed before
    metrics.jsonl is cut; but the side file's name, new in the directory, was not: a power cut
    could keep the cut and lose the file (POSIX: a new file's entry is durable once its directory
    is fsynced). Its directory is flushed before the cut."""
    from moefold.train.metrics import SUPERSEDED_FILE, MetricsSinks

    run = tmp_path.resolve()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    MetricsSinks(run, tensorboard=False, out=lambda line: None, first_step=2).close()
    side = run / SUPERSEDED_FILE
    assert [json.loads(line)["step"] for line in side.read_text().splitlines()] == [2, 3]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    flushed = durability_events.index(("fsync", side))
    assert durability_events[flushed:flushed + 2] == [("fsync", side), ("fsync", run)]


def test_a_branch_from_a_checkpoint_saved_before_a_resume_that_changed_the_model_says_so(
        tmp_path, text_corpus, capsys):
    """Trained with moe.top_k 2 to step 4 (checkpoints 2 and 4), resumed with --moe.top_k 3, which
    config.toml then holds. A run continued from step 2 in another directory reads config.toml's
    options: it trains top_k 3 from a top_k-2 checkpoint, and said nothing, since the resume checks
    compared the options with config.toml's rather than with the ones step 2 was saved with. The
    change is named as a resume that changes it is. (Since test_cli_audit10, a branch continues
    with the options step 2 was saved with: top_k 3 is given here, as a change.)"""
    from conftest import cli_args

    from moefold.cli import main

    run = tmp_path / "run"
    args = cli_args({**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "4",
                     "checkpoint.every": "2", "checkpoint.keep": "5"})
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert main(["train", "--resume", str(run), "--train.steps", "6", "--moe.top_k", "3"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000002"), "--run-dir",
                 str(tmp_path / "branch"), "--moe.top_k", "3"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: this run changes")]
    assert notes == [f"note: this run changes the model it resumes (compared with the config {run}/checkpoints/"
                     "step_00000002 was saved with): moe.top_k 2 -> 3"]


def test_a_save_that_fails_inside_the_writer_keeps_the_last_checkpoint_and_the_resume_is_the_uninterrupted_run(
        tmp_path, text_corpus, monkeypatch):
    """DCP's own writer raises (a full disk) after writing step 6's shards, with checkpoint.keep 1:
    the run stops with a CheckpointError, step 3 stays the one complete checkpoint (nothing of
    step 6 left), and the run resumed from it ends with the uninterrupted run's records and
    weights. (No defect found: a regression test.)"""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    from moefold.checkpoint.dcp import complete_checkpoints, load_checkpoint
    from moefold.errors import CheckpointError

    cfg = _config(text_corpus, **BETWEEN_LOG_STEPS, **{"checkpoint.keep": "1"})
    whole = _train(cfg, tmp_path / "whole")
    write_data = FileSystemWriter.write_data

    def full_disk_at_step_6(self, plan, planner):
        written = write_data(self, plan, planner)
        if Path(self.path).name.startswith("step_00000006"):
            written.wait()
            raise OSError(28, "No space left on device")
        return written

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk_at_step_6)
    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match="step_00000003, is intact"):
        _train(cfg, run)
    monkeypatch.undo()
    assert [step for step, _ in complete_checkpoints(run)] == [3]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000003"]
    resumed = _train(cfg, run, resume=run)
    assert metrics_records(run) == metrics_records(tmp_path / "whole")
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    state = {"step": 0}
    load_checkpoint(state, complete_checkpoints(run)[-1][1])
    assert state["step"] == 8


def test_ranks_checking_a_run_dir_at_once_do_not_refuse_each_other(tmp_path):
    """Every rank of a resumed job checks that no other training holds the run directory, at about
    the same moment. The check took the lock exclusively for an instant, so two checks at once
    refused each other ("in use by another training", naming the run's earlier process): the
    check now takes it shared, which a holder still refuses."""
    import threading

    from moefold.errors import ConfigError
    from moefold.train.run_lock import LOCK_FILE, RunDirLock, refuse_run_dir_in_use

    (tmp_path / LOCK_FILE).write_text("12345 node1 training\n")  # left by the run's earlier training
    refused = []

    def check_repeatedly():
        for _ in range(500):
            try:
                refuse_run_dir_in_use(tmp_path)
            except ConfigError as e:
                refused.append(str(e))

    ranks = [threading.Thread(target=check_repeatedly) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert refused == []
    holder = RunDirLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(ConfigError, match="is in use by another training"):
            refuse_run_dir_in_use(tmp_path)
    finally:
        holder.release()


def test_a_checkpoint_rotated_out_while_it_is_read_is_named_for_that_not_as_corrupt(tmp_path, text_corpus,
                                                                                    monkeypatch, capsys):
    """`generate` (or a run continued elsewhere) reading the latest checkpoint of a run still
    training: its next save can rotate the checkpoint out mid-read (checkpoint.keep), which was
    reported as "unreadable or corrupt". It is said as what happened, with what to do."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from moefold.cli import main

    run = tmp_path / "run"
    _train(_config(text_corpus, **{"train.steps": "2"}), run)
    checkpoint = run / "checkpoints" / "step_00000002"
    read_data = FileSystemReader.read_data

    def rotated_out_first(self, plan, planner):
        shutil.rmtree(checkpoint)  # as _rotate does, after renaming it .old
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", rotated_out_first)
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: checkpoint {checkpoint} was deleted while it was read (its run saved a later one "
        f"and checkpoint.keep rotated it out?); the run holds no complete checkpoint now (in {run / 'checkpoints'})"]
