"""A training run's lifecycle at its edges: which steps are saved, a resume with nothing left to
train, and --resume's errors."""

from pathlib import Path

import pytest

from moefold.checkpoint.dcp import complete_checkpoints
from moefold.cli import main


def _saved_steps(run: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(run)]


@pytest.mark.parametrize("every, save_at_end, saved", [
    (1, "false", [1, 2, 3, 4]), (2, "false", [2, 4]), (3, "false", [3]), (5, "false", []),
    (1, "true", [1, 2, 3, 4]), (5, "true", [4]),
])
def test_checkpoint_every_saves_each_of_its_steps_the_last_one_included(tmp_path, tiny_args, every,
                                                                        save_at_end, saved):
    """checkpoint.every=2 over 4 steps saves step 4 too, whether or not save_at_end would (without
    save_at_end the last step was skipped: a run of every=1 ended with step 3 as its newest)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "4", "--checkpoint.every",
                 str(every), "--checkpoint.save_at_end", save_at_end, "--checkpoint.keep", "10"]) == 0
    assert _saved_steps(run) == saved


def test_resuming_a_finished_run_writes_nothing_in_its_or_another_run_dir(tmp_path, tiny_args, capsys):
    """`--resume RUN --run-dir NEW` with nothing to train left NEW holding a config.toml and no
    checkpoint, a run directory every later training was refused ('holds a run that saved no
    checkpoint'), the one the message tells to continue with more steps included."""
    run, new = tmp_path / "run", tmp_path / "new"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    config = (run / "config.toml").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--run-dir", str(new)]) == 0
    assert "nothing to train: the run is already at step 3" in capsys.readouterr().out
    assert not new.exists()
    assert main(["train", "--resume", str(run), "--train.lr", "1e-4"]) == 0  # nothing trained with it
    assert (run / "config.toml").read_bytes() == config

    assert main(["train", "--resume", str(run), "--run-dir", str(new), "--train.steps", "4"]) == 0
    assert _saved_steps(new) == [4]


def test_resuming_a_checkpoint_of_a_run_without_config_toml_names_resume(tmp_path, tiny_args, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    (run / "config.toml").unlink()
    checkpoint = run / "checkpoints" / "step_00000002"
    capsys.readouterr()
    assert main(["train", "--resume", str(checkpoint), "--train.steps", "4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --resume {checkpoint}: its run directory {run} holds no config.toml "
        "(not a moefold run directory)"]
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "metrics.jsonl"]
