"""How a run's checkpoints are named to `train --resume`, `generate --run-dir` and `convert --run-dir`:
a step number as typed (`RUN/checkpoints/step_2`) names the saved `step_00000002`; convert says the
checkpoint it read; a checkpoint deleted while it is read is said with what the run holds now,
whether the latest was read or a step was named. References: the same commands given the saved
name, and the run's directory listing."""

import json
import shutil
from pathlib import Path

import pytest

STEP2, STEP4 = "step_00000002", "step_00000004"
SAMPLED = ["--prompt", "document 3: w", "--max-new-tokens", "16", "--temperature", "1", "--seed", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One 4-step training saving at steps 2 and 4."""
    from conftest import TINY_OVERRIDES, cli_args, write_text_corpus

    from moefold.cli import main

    corpus = write_text_corpus(tmp_path_factory.mktemp("corpus"))
    run = tmp_path_factory.mktemp("names") / "run"
    args = cli_args({**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": "4", "train.warmup_steps": "1",
                     "checkpoint.every": "2"})
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert _held(run) == [STEP2, STEP4]
    return run


def _held(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def _generated(capsys, run_dir: Path) -> str:
    from moefold.cli import main

    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run_dir), *SAMPLED]) == 0
    return capsys.readouterr().out


def _hf_files(hf_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(hf_dir.iterdir())}


@pytest.mark.parametrize("typed", ["step_2", "step_02", "step_000000002"])
def test_generate_takes_a_step_number_as_typed(run, capsys, typed):
    """`generate --run-dir RUN/checkpoints/step_2` said 'no such checkpoint; the run's complete
    checkpoints are step_00000002, ...': it samples step_00000002, as the saved name does, and
    differs from the latest's (sampled, seed 0)."""
    assert _generated(capsys, run / "checkpoints" / typed) == _generated(capsys, run / "checkpoints" / STEP2)
    assert _generated(capsys, run / "checkpoints" / typed) != _generated(capsys, run)


@pytest.mark.parametrize("cwd, typed, saved", [("checkpoints", "step_00000002", STEP2), ("checkpoints", "step_2", STEP2),
                                              (f"checkpoints/{STEP2}", ".", STEP2), ("checkpoints", "..", STEP4)])
def test_generate_reads_a_relative_run_dir_where_it_is(run, capsys, monkeypatch, cwd, typed, saved):
    """A --run-dir relative to the working directory was taken as written, so from inside the
    checkpoints folder `step_00000002`'s run was its parent `.` ('not a moefold run directory'), as
    was `.` inside the checkpoint: each samples what the absolute name of its checkpoint does."""
    expected = _generated(capsys, run / "checkpoints" / saved)
    monkeypatch.chdir(run / cwd)
    assert _generated(capsys, Path(typed)) == expected


def test_run_config_takes_a_step_number_as_typed(run):
    """`moefold.generate.run_config(run, RUN/checkpoints/step_2)`, the config of the model that
    `load_model_from_run` reads for the same name, read the path as given: no checkpoint there."""
    from moefold.generate import run_config

    assert run_config(run, run / "checkpoints" / "step_2") == run_config(run, run / "checkpoints" / STEP2)


def test_convert_takes_a_step_number_as_typed_and_names_the_checkpoint_it_read(run, tmp_path, capsys):
    """`convert --run-dir RUN/checkpoints/step_2` exports step_00000002, file for file as the saved
    name does; its line named the path given (`converted RUN -> D`), not the checkpoint read."""
    from moefold.cli import main

    for given, out in ((run / "checkpoints" / "step_2", "typed"), (run / "checkpoints" / STEP2, "saved"),
                       (run, "latest"), (run / "checkpoints", "folder")):
        capsys.readouterr()
        assert main(["convert", "--run-dir", str(given), "--to-hf", str(tmp_path / out)]) == 0
        read = run / "checkpoints" / (STEP2 if out in ("typed", "saved") else STEP4)
        assert capsys.readouterr().out == f"converted {read} -> {tmp_path / out}\n", given
    assert _hf_files(tmp_path / "typed") == _hf_files(tmp_path / "saved")
    assert _hf_files(tmp_path / "typed") != _hf_files(tmp_path / "latest")


def test_resume_takes_a_step_number_as_typed(run, tmp_path):
    """`train --resume RUN/checkpoints/step_2` (into a new run) continues step_00000002: step 3's
    loss equals the one resumed from the saved name, and the run it started from is unchanged."""
    from moefold.cli import main

    losses = []
    for given, out in (("step_2", "typed"), (STEP2, "saved")):
        args = ["train", "--resume", str(run / "checkpoints" / given), "--run-dir", str(tmp_path / out)]
        assert main([*args, "--train.steps", "3"]) == 0
        records = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["step"], r["loss"]) for r in records if "loss" in r])
    assert losses[0] == losses[1] and [step for step, _ in losses[0]] == [3]
    assert _held(run) == [STEP2, STEP4]


@pytest.mark.parametrize("command", ["generate", "convert", "train"])
def test_a_typed_step_the_run_does_not_hold_and_leftovers_are_still_refused(run, tmp_path, capsys, command):
    """`step_3` (no step 3) is named with the run's checkpoints; `step_2.tmp` beside the complete
    step_00000002 is no checkpoint and is refused as a leftover's name, not read as step 2."""
    from moefold.cli import main

    option = "--resume" if command == "train" else "--run-dir"
    rest = {"train": ["--train.steps", "6"], "generate": SAMPLED, "convert": ["--to-hf", str(tmp_path / "hf")]}[command]
    missing, leftover = run / "checkpoints" / "step_3", run / "checkpoints" / "step_2.tmp"
    capsys.readouterr()
    assert main([command, option, str(missing), *rest]) == 2
    assert _error_lines(capsys) == [f"moefold: error: {option} {missing}: no such checkpoint; the run's complete "
                                    f"checkpoints are {STEP2}, {STEP4} (in {run / 'checkpoints'})"]
    assert main([command, option, str(leftover), *rest]) == 2
    [line] = _error_lines(capsys)
    assert line.startswith(f"moefold: error: {option} {leftover}: not a complete checkpoint (an unfinished save)")
    assert not (tmp_path / "hf").exists() and _held(run) == [STEP2, STEP4]


def _rotated_out_while_read(monkeypatch, read: Path) -> None:
    """`read` is deleted as its first data is read, once its run has saved step 6 (checkpoint.keep
    rotating it out), as a training saving beside the command does."""
    from torch.distributed.checkpoint import FileSystemReader

    read_data = FileSystemReader.read_data

    def rotated_out_first(self, plan, planner):
        if read.exists():
            shutil.copytree(read.parent / STEP4, read.parent / "step_00000006")
            shutil.rmtree(read)
        return read_data(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", rotated_out_first)


@pytest.mark.parametrize("named", [False, True], ids=["latest", "step named"])
def test_a_checkpoint_deleted_while_it_is_read_is_said_with_what_the_run_holds_now(run, tmp_path, monkeypatch,
                                                                                  capsys, named):
    """Said 'run the command again to read the latest' also where a step was named: that reads
    another checkpoint than the one asked for. The line names the run's checkpoints now, and how
    to read its latest or one of them, right for either."""
    from moefold.cli import main

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    read = copy / "checkpoints" / (STEP2 if named else STEP4)
    _rotated_out_while_read(monkeypatch, read)
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(read if named else copy), *SAMPLED]) == 2
    now = [name for name in (STEP2, STEP4, "step_00000006") if name != read.name]
    assert _held(copy) == now
    assert _error_lines(capsys) == [
        f"moefold: error: checkpoint {read} was deleted while it was read (its run saved a later one and "
        f"checkpoint.keep rotated it out?); the run's complete checkpoints are now {', '.join(now)} (in "
        f"{copy / 'checkpoints'}): run the command again with the run directory to read its latest, or with one "
        "of them"]
