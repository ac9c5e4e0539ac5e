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
