"""A resume over other training data of the same size is refused, as one of another size is: the
checkpoint's data position (epoch, cursor) counts in the sequences it was trained on."""

from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_OVERRIDES, cli_args
from moefold.cli import main
from test_bad_input import error_line

_TOKENS = 4_000


def _write_tokens(path: Path, seed: int) -> None:
    np.save(path, np.random.default_rng(seed).integers(0, 256, _TOKENS, dtype=np.uint16))


@pytest.fixture
def token_run(tmp_path) -> tuple[Path, list[str]]:
    corpus = tmp_path / "corpus.npy"
    _write_tokens(corpus, seed=0)
    args = cli_args({**TINY_OVERRIDES, "data.path": str(corpus)})
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *args, "--train.steps", "3"]) == 0
    return run, corpus


def test_a_resume_over_other_data_of_as_many_sequences_is_refused(token_run, capsys):
    run, corpus = token_run
    _write_tokens(corpus, seed=1)  # other ids, as many: the sequence count cannot tell
    line = error_line(capsys, ["train", "--resume", str(run), "--train.steps", "5"])
    assert "data.path" in line and "step_00000003" in line


def test_a_resume_over_the_same_data_rewritten_continues(token_run):
    run, corpus = token_run
    _write_tokens(corpus, seed=0)  # the same ids in a new file
    assert main(["train", "--resume", str(run), "--train.steps", "5"]) == 0
