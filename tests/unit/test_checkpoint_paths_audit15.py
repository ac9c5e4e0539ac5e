"""`resolve_checkpoint` and `generate.run_config` given a path relative to the working directory
whose written form has no parent name to read (`step_2`, `.`, `..` from inside a run's checkpoints
folder or one of its checkpoints): the command line makes its paths absolute first, the Python API
took them as written. Reference: the same calls given the absolute path."""

from pathlib import Path

import pytest
from test_checkpoint_names_audit13 import STEP2, STEP4, run  # noqa: F401 (module fixture)

from moefold.checkpoint.dcp import resolve_checkpoint

RELATIVE = [("checkpoints", "step_2", STEP2), ("checkpoints", STEP2, STEP2), ("checkpoints", ".", STEP4),
            (f"checkpoints/{STEP2}", ".", STEP2), (f"checkpoints/{STEP2}", "..", STEP4),
            (f"checkpoints/{STEP2}", "../step_4", STEP4), ("checkpoints", "../checkpoints/step_2", STEP2)]


@pytest.mark.parametrize("cwd, typed, saved", RELATIVE)
def test_resolve_checkpoint_reads_a_relative_path_where_it_is(run, monkeypatch, cwd, typed, saved):  # noqa: F811
    monkeypatch.chdir(run / cwd)
    assert resolve_checkpoint(Path(typed)).resolve() == run / "checkpoints" / saved


@pytest.mark.parametrize("cwd, typed, saved", RELATIVE)
def test_run_config_reads_a_relative_checkpoint_where_it_is(run, monkeypatch, cwd, typed, saved):  # noqa: F811
    from moefold.generate import run_config

    expected = run_config(run, run / "checkpoints" / saved)
    monkeypatch.chdir(run / cwd)
    assert run_config(run, Path(typed)) == expected


def test_a_missing_relative_step_is_said_with_the_steps_the_run_holds(run, monkeypatch):  # noqa: F811
    from moefold.checkpoint.dcp import CheckpointError

    monkeypatch.chdir(run / "checkpoints")
    with pytest.raises(CheckpointError, match=f"step_3: no such checkpoint; the run's complete checkpoints "
                                              f"are {STEP2}, {STEP4}"):
        resolve_checkpoint(Path("step_3"))
