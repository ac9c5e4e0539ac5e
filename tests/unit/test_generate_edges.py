"""Edges of `moefold generate` and `moefold.generate.sample`: input the command line must refuse in
one line (exit 2, no traceback)."""

import pytest

from moefold.cli import main


@pytest.fixture
def finished_run(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    return run


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(finished_run, capsys):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (PEP 383),
    which no tokenizer encodes: the byte tokenizer's str.encode raised UnicodeEncodeError, a
    traceback and exit 1."""
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(finished_run), "--prompt", "caf\udce9 au lait"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--prompt" in err and "UTF-8" in err and "byte 0xe9" in err, err
