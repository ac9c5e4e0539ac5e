"""What `train --resume` makes of a path beside the one it takes: a run's checkpoints folder, a
leftover of a save given to the Python `Trainer`, and a saved layout that does not fit the ranks
started. (`generate`/`convert --run-dir` of a checkpoint: test_generate_checkpoint_audit13.)"""

import json
import shutil

import pytest


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def _train_args(tiny_args, steps: int) -> list[str]:
    return [*tiny_args, "--train.steps", str(steps), "--train.warmup_steps", "1"]


@pytest.fixture
def two_step_run(tmp_path, tiny_args):
    """A 2-step run, checkpoint at step 2."""
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *_train_args(tiny_args, 2)]) == 0
    return run


def _losses(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_of_a_runs_checkpoints_folder_continues_its_latest_checkpoint(two_step_run, tmp_path):
    """`--resume RUN/checkpoints` (the folder Megatron-LM's --load and TorchTitan's checkpoint.folder
    name) said 'not a moefold run directory (no config.toml)'; from Python, 'no complete checkpoint
    in RUN/checkpoints/checkpoints'. It continues the run's latest checkpoint, as `--resume RUN`:
    the same step 3, to the bit, as the resume of a copy of the run by its directory."""
    from moefold.cli import main
    from moefold.config import config_from_toml
    from moefold.train.trainer import Trainer

    by_dir, by_python = tmp_path / "by-dir", tmp_path / "by-python"
    for copy in (by_dir, by_python):
        shutil.copytree(two_step_run, copy)
    assert main(["train", "--resume", str(by_dir), "--train.steps", "3"]) == 0
    assert main(["train", "--resume", str(two_step_run / "checkpoints"), "--train.steps", "3"]) == 0
    Trainer(config_from_toml(by_python / "config.toml", {"train.steps": 3}), by_python,
            resume=by_python / "checkpoints", out=lambda line: None).fit()
    for run in (two_step_run, by_python):
        assert (run / "checkpoints" / "step_00000003").is_dir()
        assert _losses(run)[3] == _losses(by_dir)[3]


def test_resume_of_an_empty_checkpoints_folder_names_it(tmp_path, tiny_args, capsys):
    """A run that saved nothing yet: its checkpoints folder is named as holding no checkpoint."""
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *_train_args(tiny_args, 2), "--checkpoint.save_at_end", "false"]) == 0
    (run / "checkpoints").mkdir(exist_ok=True)
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints"), "--train.steps", "3"]) == 2
    assert _error_lines(capsys) == [f"moefold: error: --resume {run / 'checkpoints'}: no complete checkpoint "
                                    f"in {run / 'checkpoints'}"]


@pytest.mark.parametrize("name, what", [("step_00000004.tmp", "an unfinished save"),
                                        ("step_00000004.old", "a checkpoint being deleted"),
                                        ("latest", "not a checkpoint's name, step_<N>")])
def test_python_resume_of_a_leftover_says_what_the_command_line_says(two_step_run, tmp_path, capsys, name, what):
    """`Trainer(..., resume=RUN/checkpoints/step_N.tmp)` said dcp's 'no complete checkpoint in
    RUN/checkpoints/step_N.tmp/checkpoints', where the command line says what the folder is and
    what to give: the same line now, from one check."""
    from moefold.cli import main
    from moefold.config import config_from_toml
    from moefold.errors import UserError
    from moefold.train.trainer import Trainer

    leftover = two_step_run / "checkpoints" / name
    shutil.copytree(two_step_run / "checkpoints" / "step_00000002", leftover)
    (leftover / ".metadata").unlink()  # DCP writes it last: a save killed half-way has none
    expected = (f"--resume {leftover}: not a complete checkpoint ({what}); give the run directory "
                f"{two_step_run} (its latest checkpoint) or one of its complete checkpoints, "
                f"{two_step_run / 'checkpoints'}/step_<N>")
    with pytest.raises(UserError) as refused:
        Trainer(config_from_toml(two_step_run / "config.toml", {"train.steps": 4}), tmp_path / "other",
                resume=leftover, out=lambda line: None)
    assert str(refused.value) == expected
    capsys.readouterr()
    assert main(["train", "--resume", str(leftover), "--train.steps", "4"]) == 2
    assert _error_lines(capsys) == [f"moefold: error: {expected}"]
    assert not (tmp_path / "other").exists()


def test_resume_on_ranks_a_saved_layout_does_not_fit_says_where_it_came_from(two_step_run, tmp_path, capsys,
                                                                           monkeypatch):
    """`--resume RUN --nproc 2` of a run whose config.toml holds parallel.ep 4 said 'parallel: world
    size 2 is not divisible by etp·ep·pp = 4 (etp=1, ep=4, pp=1)': not that ep came from config.toml,
    nor what fits. 94880ad said it for one process; now for any world size, --nproc's or torchrun's,
    with the largest sizes that fit the ranks started."""
    from moefold.cli import main

    config = two_step_run / "config.toml"
    config.write_text(config.read_text().replace("\nep = 1\n", "\nep = 4\n"))  # as a 4-rank run's
    resume = ["train", "--resume", str(two_step_run), "--train.steps", "3", "--run-dir", str(tmp_path / "b")]
    for nproc, fits in ((2, "--parallel.ep 2"), (3, "--parallel.ep 1")):
        capsys.readouterr()
        assert main([*resume, "--nproc", str(nproc)]) == 2
        assert _error_lines(capsys) == [
            f"moefold: error: --resume {two_step_run}: parallel.ep=4 (from {config}) needs a multiple of 4 ranks "
            f"and --nproc {nproc} starts {nproc}: start a multiple of 4 (--nproc 4, or torchrun), or resume on "
            f"{nproc} ranks with {fits} (a checkpoint resumes under another layout)"]
    monkeypatch.setenv("WORLD_SIZE", "6")  # torchrun's 6 ranks: ep 4 does not divide 6, ep 2 does
    capsys.readouterr()
    assert main(resume) == 2
    assert _error_lines(capsys) == [
        f"moefold: error: --resume {two_step_run}: parallel.ep=4 (from {config}) needs a multiple of 4 ranks and "
        "this job has 6: start a multiple of 4 (--nproc 4, or torchrun), or resume on 6 ranks with "
        "--parallel.ep 2 (a checkpoint resumes under another layout)"]
    assert not (tmp_path / "b").exists()


def test_resume_on_ranks_names_the_layout_a_checkpoint_was_saved_with(tmp_path, tiny_args, capsys):
    """A 2-rank parallel.ep 2 run's step 2 resumed with --nproc 3: the sizes are named as those of
    the config step 2 was saved with (as by the run, from its config.toml)."""
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *_train_args(tiny_args, 2), "--nproc", "2",
                 "--parallel.ep", "2"]) == 0
    step2 = run / "checkpoints" / "step_00000002"
    for resume, source in ((run, run / "config.toml"), (step2, f"the config {step2} was saved with")):
        capsys.readouterr()
        assert main(["train", "--resume", str(resume), "--train.steps", "3", "--run-dir", str(tmp_path / "b"),
                     "--nproc", "3"]) == 2
        assert _error_lines(capsys) == [
            f"moefold: error: --resume {resume}: parallel.ep=2 (from {source}) needs a multiple of 2 ranks and "
            "--nproc 3 starts 3: start a multiple of 2 (--nproc 2, or torchrun), or resume on 3 ranks with "
            "--parallel.ep 1 (a checkpoint resumes under another layout)"]
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("world, sizes", [(2, {"pp": 2, "ep": 2}), (6, {"tp": 4, "ep": 4}), (4, {"ep": 8, "etp": 2}),
                                          (3, {"cp": 2, "pp": 3}), (12, {"tp": 8, "pp": 2, "ep": 8})])
def test_the_sizes_suggested_fit_the_ranks_and_no_larger_ones_do(world, sizes):
    """The suggestion, checked against every smaller layout by brute force over ParallelDims: it
    fits `world`, each size divides the saved one, and no fitting layout keeps more parallelism."""
    import itertools
    import math

    from moefold.cli import _sizes_that_fit
    from moefold.errors import ConfigError
    from moefold.parallel.dims import ParallelDims

    suggested = _sizes_that_fit(world, {f"parallel.{k}": v for k, v in sizes.items()}, "tp-cp-ep-dp-pp")
    names = list(sizes)
    fitting = []
    for combo in itertools.product(*(range(1, sizes[n] + 1) for n in names)):
        if all(sizes[n] % c == 0 for n, c in zip(names, combo)):
            try:
                ParallelDims(world, **dict(zip(names, combo)))
            except ConfigError:
                continue
            fitting.append(math.prod(combo))
    assert set(suggested) == {f"parallel.{n}" for n in names}
    assert all(sizes[n] % suggested[f"parallel.{n}"] == 0 for n in names)
    ParallelDims(world, **{n: suggested[f"parallel.{n}"] for n in names})
    assert math.prod(suggested.values()) == max(fitting)
