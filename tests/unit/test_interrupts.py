"""Runs that are interrupted (SIGINT, SIGTERM, a kill) or fail part-way keep what they wrote whole:
checkpoints, metrics.jsonl and config.toml; signals land at chosen moments through hooks that send
them from inside the process, not through timing."""

import copy
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from moefold.checkpoint.dcp import complete_checkpoints, latest_checkpoint
from moefold.cli import main

_SIGINT_WHILE_BUILDING_THE_PARSER = """
import os, signal, sys
# Python turns SIGINT into KeyboardInterrupt only if its parent did not ignore the signal, as a
# shell does for the jobs it starts in the background: a Ctrl-C from a terminal is what is tested.
signal.signal(signal.SIGINT, signal.default_int_handler)
import moefold.cli as cli
add_plan_parser = cli._add_plan_parser
def interrupted(commands):  # Ctrl-C in the seconds the parser's imports (torch) take
    os.kill(os.getpid(), signal.SIGINT)
    add_plan_parser(commands)
cli._add_plan_parser = interrupted
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_command_line_starts_is_one_line_and_130():
    result = subprocess.run([sys.executable, "-c", _SIGINT_WHILE_BUILDING_THE_PARSER, "train"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (128 + signal.SIGINT, "moefold: interrupted\n")


def _signal_during_save_of(monkeypatch, step: int, signum: int) -> list[str]:
    """DCP's save sends `signum` to this process as it starts on checkpoint `step`; the returned
    list fills with the directory of every save."""
    import moefold.checkpoint.dcp as checkpoint

    saves, save = [], checkpoint.dcp.save

    def save_signalled(state, checkpoint_id):
        saves.append(Path(checkpoint_id).name)
        if state["step"] == step:
            os.kill(os.getpid(), signum)
        return save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", save_signalled)
    return saves


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_due_save_stops_with_that_checkpoint_written_once(tmp_path, tiny_args, capsys,
                                                                            monkeypatch, signum):
    """The save the signal lands in finishes and is the checkpoint the run stops with: not written
    a second time (twice the time a scheduler's grace period has to cover; with checkpoint.keep 1
    the only checkpoint was swapped out for its copy)."""
    run = tmp_path / "run"
    saves = _signal_during_save_of(monkeypatch, 4, signum)
    assert main(["train", "--run-dir", str(run), *tiny_args, "--checkpoint.every", "2",
                 "--checkpoint.keep", "1"]) == 128 + signum
    assert saves == ["step_00000002.tmp", "step_00000004.tmp"]
    assert [step for step, _ in complete_checkpoints(run)] == [4]
    checkpoint = run / "checkpoints" / "step_00000004"
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: interrupted by {signal.Signals(signum).name} at step 4; checkpoint saved to {checkpoint}"]
    assert main(["train", "--resume", str(run)]) == 0
    assert latest_checkpoint(run).name == "step_00000012"


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_cuts_off_an_incomplete_last_record_and_appends_whole_lines(tmp_path, tiny_args, capsys):
    """metrics.jsonl ending in half a record (a write cut short by a kill): the resumed run says
    so, removes that piece and appends its records as lines of their own; every earlier record stays."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3", "--train.warmup_steps", "1"]) == 0
    before = _records(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 4.1')
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "5"]) == 0
    after = _records(run)  # every line is JSON
    assert after[:len(before)] == before
    assert [r["step"] for r in after[len(before):] if "loss" in r] == [4, 5]
    assert f"{run / 'metrics.jsonl'}: removed its last line, an incomplete record of 23 bytes" in capsys.readouterr().out


def test_metrics_sinks_cut_only_an_incomplete_last_line(tmp_path):
    from moefold.train.metrics import MetricsSinks

    path = tmp_path / "metrics.jsonl"
    for content, kept in ((b"", b""), (b'{"step": 1}\n', b'{"step": 1}\n'), (b'{"st', b""),
                          (b'{"step": 1}\n' * 10000 + b'{"step": 2', b'{"step": 1}\n' * 10000)):
        path.write_bytes(content)
        said = []
        MetricsSinks(tmp_path, tensorboard=False, out=said.append, first_step=3).close()  # resumed at 2
        assert path.read_bytes() == kept
        assert len(said) == (content != kept)


def _files(run: Path) -> dict[Path, bytes]:
    """Every file of a run but its .lock (who last trained in it)."""
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_continuing_an_earlier_checkpoint_among_later_ones_or_into_another_run_is_refused(tmp_path, tiny_args,
                                                                                          capsys):
    """Resuming step 4 of a run that holds steps 4–8 in place would mix two histories, and the
    rotation (which keeps the highest steps) deleted each new checkpoint as it was saved; a
    --run-dir holding another run had its config.toml and checkpoints replaced. Both are refused
    before anything is written; a new --run-dir continues from step 4."""
    run, other = tmp_path / "run", tmp_path / "other"
    for path in (run, other):
        assert main(["train", "--run-dir", str(path), *tiny_args, "--train.steps", "8",
                     "--checkpoint.every", "2", "--checkpoint.keep", "3"]) == 0
    step4 = run / "checkpoints" / "step_00000004"
    before = {path: _files(path) for path in (run, other)}
    capsys.readouterr()
    for argv, expected in (
            (["--resume", str(step4)],
             f"--resume {step4}: {run} holds later checkpoints (step_00000006, step_00000008) that the "
             "continued run would be mixed with; continue it in a new --run-dir, or delete those checkpoints"),
            (["--resume", str(step4), "--run-dir", str(other)],
             f"--run-dir {other} already holds a run; continue it with --resume {other} or choose another --run-dir")):
        assert main(["train", *argv, "--train.steps", "10"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"moefold: error: {expected}"]
    assert {path: _files(path) for path in (run, other)} == before
    branch = tmp_path / "branch"
    assert main(["train", "--resume", str(step4), "--run-dir", str(branch), "--train.steps", "10"]) == 0
    assert [step for step, _ in complete_checkpoints(branch)] == [6, 8, 10]
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000008"), "--train.steps", "10"]) == 0
    assert [step for step, _ in complete_checkpoints(run)] == [6, 8, 10]


def _tiny_config(text_corpus: Path, **overrides: str):
    from conftest import TINY_OVERRIDES

    from moefold.config import load_config

    return load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2",
                              "train.warmup_steps": "1", **overrides})


def test_a_second_training_in_a_run_dir_in_use_is_refused_until_the_first_ends(tmp_path, text_corpus, tiny_args,
                                                                                capsys):
    """Two resumes of one run at once wrote one metrics.jsonl and one checkpoint directory (each
    save removing the other's half-written one): the second is refused, naming the first, before
    it builds anything; once the first has returned from fit(), the run is free to continue."""
    from moefold.train.trainer import Trainer

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    first = Trainer(_tiny_config(text_corpus, **{"train.steps": "4"}), run, resume=run, out=lambda line: None)
    before = _files(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "6"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --run-dir {run} is in use by another training (process {os.getpid()} on "
        f"{socket.gethostname()}); wait for it to end, or choose another --run-dir"]
    assert _files(run) == before
    first.fit()
    assert main(["train", "--resume", str(run), "--train.steps", "6"]) == 0
    assert latest_checkpoint(run).name == "step_00000006"


def test_resuming_a_run_that_trains_before_its_first_save_names_the_training(tmp_path, text_corpus, capsys):
    """--resume of a run still training before its first save said "no complete checkpoint", as if
    the run had died: it names the training that holds the run, as a resume after the save does."""
    from moefold.train.trainer import Trainer

    run = tmp_path / "run"
    first = Trainer(_tiny_config(text_corpus), run, out=lambda line: None)
    assert main(["train", "--resume", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --resume {run} is in use by another training (process {os.getpid()} on "
        f"{socket.gethostname()}); wait for it to end, or choose another --resume"]
    first.fit()
    assert main(["train", "--resume", str(run), "--train.steps", "3"]) == 0


@pytest.mark.parametrize("first_ends", [False, True], ids=["first-training", "first-trained"])
def test_of_two_trainings_started_in_one_new_run_dir_the_second_to_write_is_refused(tmp_path, text_corpus,
                                                                                    monkeypatch, first_ends):
    """Both found the --run-dir empty at start-up, then both wrote into it (config.toml, metrics,
    checkpoints). Another training starts there while this one loads its data: this one is refused
    when it comes to write, whether the other is still training there or has finished."""
    from moefold.errors import ConfigError
    from moefold.train.trainer import Trainer

    cfg, run = _tiny_config(text_corpus), tmp_path / "run"
    others = []
    build_data = Trainer._build_data

    def another_training_starts_meanwhile(self):
        build_data(self)
        if self.cfg.train.seed == 0:  # this training, not the other
            others.append(Trainer(_tiny_config(text_corpus, **{"train.seed": "1"}), run, out=lambda line: None))
            if first_ends:
                others[0].fit()

    monkeypatch.setattr(Trainer, "_build_data", another_training_starts_meanwhile)
    expected = (f"--run-dir {run} already holds a run; continue it with --resume {run}" if first_ends else
                f"--run-dir {run} is in use by another training")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        Trainer(cfg, run, out=lambda line: None)
    if not first_ends:
        others[0].fit()
    assert 'seed = 1' in (run / "config.toml").read_text()
    assert [step for step, _ in complete_checkpoints(run)] == [2]


def test_a_full_disk_while_config_toml_is_rewritten_names_it_and_keeps_the_old_one(tmp_path, tiny_args, capsys,
                                                                                  monkeypatch):
    """A resume rewrites config.toml (its overrides): on a full disk the line names the file (a
    write cut short carries no file name: 'writing an output') and the run is as it was, with no
    partial config.toml.tmp left beside it."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    before = _files(run)
    write_text = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if self.name != "config.toml.tmp":
            return write_text(self, data, *args, **kwargs)
        write_text(self, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: writing {run / 'config.toml'}: No space left on device; free space (or choose another "
        "directory) and run again"]
    assert _files(run) == before



def test_config_toml_is_flushed_to_disk_before_its_rename_and_its_directory_after(tmp_path, text_corpus,
                                                                                  durability_events):
    """Renamed unflushed, a power cut soon after could leave config.toml empty (ext4 and XFS may
    write the rename before the data), and the run could not be resumed."""
    from moefold.train.trainer import Trainer

    run = tmp_path.resolve() / "run"  # as /proc/self/fd names the files
    events = durability_events
    Trainer(_tiny_config(text_corpus), run, out=lambda line: None)
    tmp, config = run / "config.toml.tmp", run / "config.toml"
    assert [e for e in events if any(run in (p, *p.parents) for p in e[1:])] == [
        ("fsync", tmp), ("replace", tmp, config), ("fsync", run)]

def _input_output_error(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")


def _eio_in_checkpoint_shards(monkeypatch):
    import moefold.checkpoint.dcp as checkpoint

    def save(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        _input_output_error()

    monkeypatch.setattr(checkpoint.dcp, "save", save)


def _eio_in_checkpoint_rename(monkeypatch):
    replace = os.replace

    def failing(src, dst):
        if Path(dst).parent.name == "checkpoints":  # the saved checkpoint's .tmp into place
            _input_output_error()
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)


def _eio_in_metrics(monkeypatch):
    from moefold.train.metrics import MetricsSinks

    class FailingFile:
        def __init__(self, file):
            self.file, self.write = file, _input_output_error

        def __getattr__(self, name):
            return getattr(self.file, name)

    opened = MetricsSinks.__init__

    def open_on_a_failing_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self.jsonl = FailingFile(self.jsonl)

    monkeypatch.setattr(MetricsSinks, "__init__", open_on_a_failing_disk)


def _eio_in_config_toml(monkeypatch):
    write_text = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, *args, **kwargs: _input_output_error()
                        if self.name == "config.toml.tmp" else write_text(self, *args, **kwargs))


@pytest.mark.parametrize("fail, written", [(_eio_in_checkpoint_shards, "checkpoints/step_00000004"),
                                           (_eio_in_checkpoint_rename, "checkpoints/step_00000004"),
                                           (_eio_in_metrics, "metrics.jsonl"),
                                           (_eio_in_config_toml, "config.toml")],
                         ids=["checkpoint-shards", "checkpoint-rename", "metrics", "config"])
def test_an_io_error_writing_the_run_is_one_line_naming_the_output_and_keeps_what_was_written(
        tmp_path, tiny_args, capsys, monkeypatch, fail, written):
    """EIO (a failing disk, a stale NFS handle) while a checkpoint, metrics or config.toml is
    written ended in a traceback: one line names the output and the OS error, with status 1 (the
    storage failed, not the input); the checkpoint before and the file's earlier records stay."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    kept = _files(run / "checkpoints" / "step_00000002")
    before = (run / written).read_bytes() if (run / written).is_file() else None
    fail(monkeypatch)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "4"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: writing {run / written}: [Errno {errno.EIO}] Input/output error"]
    assert [step for step, _ in complete_checkpoints(run)] == [2]
    assert _files(run / "checkpoints" / "step_00000002") == kept
    if before is not None:
        assert (run / written).read_bytes() == before

class _FailingTensorBoard:
    """A TensorBoard writer (tensorboard is optional and absent on the test machine) whose disk
    fails at `fail` (open, the third record's scalars, close) with EIO."""

    def __init__(self, fail: str, calls: list[str]):
        self.fail, self.calls, self.records = fail, calls, 0
        self._call("open")

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            _input_output_error()

    def add_scalar(self, key, value, step):
        if key == "loss":
            self.records += 1
            self._call("add_scalar" if self.records == 3 else "add_scalar (before)")

    def close(self):
        self._call("close")


@pytest.mark.parametrize("fail", ["open", "add_scalar", "close"])
def test_tensorboard_failing_to_write_is_said_once_and_turned_off_and_the_run_trains_on(
        tmp_path, tiny_args, capsys, monkeypatch, fail):
    """EIO writing TensorBoard's events ended the run in a traceback. They are a copy of
    metrics.jsonl, for viewing: the failure is said once, they are off for the rest of the run,
    and the run trains on to its end with every checkpoint and record."""
    import moefold.train.metrics as metrics

    calls = []
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda path, first_step: _FailingTensorBoard(fail, calls))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--logging.tensorboard", "true"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if "TensorBoard" in line] == [
        f"warning: writing {run / 'tb'}: [Errno {errno.EIO}] Input/output error; TensorBoard events are off "
        "for the rest of this run (metrics.jsonl holds every record)"]
    assert err == ""
    assert calls[-1] == fail  # nothing written to it after it failed
    assert [r["step"] for r in _records(run) if "loss" in r] == list(range(1, 13))
    assert latest_checkpoint(run).name == "step_00000012"


def test_a_signal_between_log_steps_logs_the_steps_since_the_last_one(tmp_path, tiny_args, monkeypatch):
    """SIGTERM in step 6 of a run that logs every 4: the run stops with step 6 saved and a record
    of steps 5–6, not with their metrics never written (the resumed run logs from step 7 on)."""
    from moefold.train.trainer import Trainer

    reference = tmp_path / "reference"
    assert main(["train", "--run-dir", str(reference), *tiny_args]) == 0
    losses = {r["step"]: r["loss"] for r in _records(reference) if "loss" in r}
    train_step = Trainer.train_step

    def signalled_in_step_6(self):
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", signalled_in_step_6)
    for collective in ("new_group", "all_reduce"):  # one process stops on its own signal, not a vote
        monkeypatch.setattr(torch.distributed, collective, lambda *args, **kwargs: pytest.fail("a collective"))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--logging.log_every", "4"]) == 128 + signal.SIGTERM
    assert latest_checkpoint(run).name == "step_00000006"
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    logged = {r["step"]: r["loss"] for r in _records(run) if "loss" in r}
    assert list(logged) == [4, 6, 8, 12]
    for step, first in ((4, 1), (6, 5), (8, 7), (12, 9)):
        assert logged[step] == pytest.approx(sum(losses[s] for s in range(first, step + 1)) / (step + 1 - first))


def test_a_signal_in_the_last_step_still_draws_the_whole_runs_expert_load_heatmap(tmp_path, tiny_args,
                                                                                monkeypatch):
    """The stop raised before the end of the run, where the heatmap is drawn: a run that had
    trained every step ended without it. It is drawn, from the uninterrupted run's history, and
    the run still ends as a signalled one (a --nproc launcher expects 128 + the signal)."""
    import moefold.train.trainer as trainer

    drawn = []

    def draw(history, path, layer_ids):
        drawn.append((Path(path), copy.deepcopy(history)))
        return path

    monkeypatch.setattr(trainer, "write_load_heatmap", draw)
    heatmap = ["--logging.expert_load_heatmap", "true", "--train.steps", "4"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert main(["train", "--run-dir", str(reference), *tiny_args, *heatmap]) == 0
    train_step = trainer.Trainer.train_step

    def signalled_in_the_last_step(self):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", signalled_in_the_last_step)
    assert main(["train", "--run-dir", str(run), *tiny_args, *heatmap]) == 128 + signal.SIGTERM
    assert latest_checkpoint(run).name == "step_00000004"
    assert [path for path, _ in drawn] == [reference / "expert_load.png", run / "expert_load.png"]
    assert len(drawn[0][1]) == 4 and drawn[1][1] == drawn[0][1]

@pytest.mark.parametrize("name, kind", [("metrics.jsonl", "directory"), (".lock", "directory"),
                                        ("checkpoints", "file")])
def test_an_entry_of_the_run_dir_of_the_wrong_kind_is_refused_in_one_line(tmp_path, tiny_args, capsys, name, kind):
    """A directory where the run writes a file (or the reverse) failed with a traceback once training
    had started, or, for checkpoints in a new run, was taken for a run without a checkpoint (a
    resume says it finds no checkpoint there)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    fresh = tmp_path / "fresh"
    runs = [(fresh, ["--run-dir", str(fresh), *tiny_args])]
    if name != "checkpoints":
        runs.append((run, ["--resume", str(run), "--train.steps", "4"]))
    for run_dir, argv in runs:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
        path.parent.mkdir(exist_ok=True)
        path.mkdir() if kind == "directory" else path.write_text("")
        before = _files(run_dir)
        capsys.readouterr()
        assert main(["train", *argv]) == 2
        expected = "file" if kind == "directory" else "directory"
        assert capsys.readouterr().err.splitlines() == [
            f"moefold: error: --run-dir {run_dir}: {name} is a {kind}, where the run keeps its {name} {expected}; "
            "move it away, or choose another --run-dir"]
        assert _files(run_dir) == before


_KILLED_WHILE_ROTATING = """
import os, shutil, signal, sys
from pathlib import Path
import moefold.checkpoint.dcp as ckpt
rmtree = shutil.rmtree
def killed_halfway(path, *args, **kwargs):
    shards = list(Path(path).glob("*.distcp")) if Path(path).is_dir() else []
    if shards and (Path(path) / ".metadata").is_file():  # a checkpoint being removed
        for shard in shards:
            shard.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    return rmtree(path, *args, **kwargs)
ckpt.shutil.rmtree = killed_halfway
from moefold.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_removal_of_an_old_checkpoint_killed_halfway_leaves_no_complete_looking_one(tmp_path, tiny_args):
    """checkpoint.keep removes the oldest after a save; killed with its shards gone and .metadata
    still there, it was listed as a complete checkpoint that cannot be read."""
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_ROTATING, "train", "--run-dir", str(run), *tiny_args,
                             "--train.steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "2"],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [step for step, _ in complete_checkpoints(run)] == [4, 6]
    assert main(["train", "--resume", str(run), "--train.steps", "8"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]


def test_the_next_save_removes_what_saves_and_removals_cut_short_left_at_any_step(tmp_path, tiny_args):
    """SIGKILL in a save at step 517 (a scheduler's grace period over), resumed from step 500:
    the partial step_517.tmp, a whole checkpoint's size, was removed only by a save of step 517."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "4", "--checkpoint.every", "2"]) == 0
    (run / "checkpoints" / "step_00000003.tmp").mkdir()
    (run / "checkpoints" / "step_00000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (run / "checkpoints" / "step_00000001.old").mkdir()
    assert main(["train", "--resume", str(run), "--train.steps", "6"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
