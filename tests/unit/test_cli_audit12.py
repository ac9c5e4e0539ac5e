"""The CLI's resume, generate and convert paths: what a path under a run's checkpoints/ that is not
a complete checkpoint, a layout one process cannot hold and a resume that changes the model say."""

import shutil

import pytest


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


@pytest.fixture
def two_step_run(tmp_path, tiny_args):
    """A 2-step run, checkpoint at step 2."""
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    return run


@pytest.mark.parametrize("suffix, what", [(".tmp", "an unfinished save"), (".old", "a checkpoint being deleted")])
def test_resume_of_a_leftover_under_checkpoints_is_refused_in_one_line(two_step_run, capsys, suffix, what):
    """`--resume RUN/checkpoints/step_N.tmp` (a save killed before its rename) passed as a checkpoint
    (any step_* name did) and was read as a run directory: 'no complete checkpoint in
    RUN/checkpoints/step_N.tmp/checkpoints'. It names the path, says what it is and what to give."""
    from moefold.cli import main

    leftover = two_step_run / "checkpoints" / f"step_00000004{suffix}"
    shutil.copytree(two_step_run / "checkpoints" / "step_00000002", leftover)
    (leftover / ".metadata").unlink()  # DCP writes it last: a save killed half-way has none
    capsys.readouterr()
    assert main(["train", "--resume", str(leftover), "--train.steps", "4"]) == 2
    assert _error_lines(capsys) == [
        f"moefold: error: --resume {leftover}: not a complete checkpoint ({what}); give the run directory "
        f"{two_step_run} (its latest checkpoint) or one of its complete checkpoints, "
        f"{two_step_run / 'checkpoints'}/step_<N>"]
    assert leftover.is_dir() and not (two_step_run / "checkpoints" / "step_00000004").exists()


def test_resume_of_a_run_directory_in_a_folder_named_checkpoints(tmp_path, tiny_args):
    """A run kept in a folder named checkpoints (`checkpoints/my-run`) is a run, not a leftover."""
    from moefold.cli import main

    run = tmp_path / "checkpoints" / "my-run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0
    assert main(["train", "--resume", str(run), "--train.steps", "3"]) == 0
    assert (run / "checkpoints" / "step_00000003").is_dir()


def test_one_process_resume_of_a_two_rank_run_says_where_parallel_ep_came_from(tmp_path, tiny_args, capsys):
    """A run trained on 2 ranks with parallel.ep 2, resumed in one process: the error named
    parallel.ep but not that it came from the run's saved config (config.toml, or the config its
    checkpoint was saved with), nor that --parallel.ep 1 resumes it here (DCP reshards any layout)."""
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1",
                 "--nproc", "2", "--parallel.ep", "2"]) == 0
    step2 = run / "checkpoints" / "step_00000002"
    capsys.readouterr()
    for resume, source in ((run, run / "config.toml"), (step2, f"the config {step2} was saved with")):
        assert main(["train", "--resume", str(resume), "--train.steps", "3", "--run-dir", str(tmp_path / "b")]) == 2
        assert _error_lines(capsys) == [
            f"moefold: error: --resume {resume}: parallel.ep=2 (from {source}) needs 2 ranks and this is one "
            "process: start them with --nproc 2 (or torchrun), or resume on one process with --parallel.ep 1 "
            "(a checkpoint resumes under another layout)"]
    assert main(["train", "--resume", str(step2), "--train.steps", "3", "--run-dir", str(tmp_path / "b"),
                 "--parallel.ep", "1"]) == 0
    assert (tmp_path / "b" / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.parametrize("holds_config", [True, False])
def test_a_resume_that_changes_the_model_names_what_it_compares_with(tmp_path, tiny_args, capsys, monkeypatch,
                                                                    holds_config):
    """'note: this run changes the model it resumes: moe.top_k 2 -> 3' did not say whose 2 it was:
    the config the checkpoint was saved with, or (a checkpoint without one: an earlier moefold's,
    weights only) the run's config.toml."""
    import moefold.train.trainer as trainer
    from moefold.cli import main

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        if not holds_config:
            patch.setattr(trainer, "CONFIG_KEY", "not_the_config")  # saved under another key: none found
        assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2",
                     "--train.warmup_steps", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "3", "--moe.top_k", "3"]) == 0
    source = (f"the config {run / 'checkpoints' / 'step_00000002'} was saved with" if holds_config
              else str(run / "config.toml"))
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: this run")] == [
        f"note: this run changes the model it resumes (compared with {source}): moe.top_k 2 -> 3"]


def test_generate_builds_the_tokenizer_once(two_step_run, monkeypatch, capsys):
    """generate built the run's tokenizer for the prompt (cli._prompt_ids), then again with the
    model (load_model_from_run): a Hugging Face tokenizer.json of 150k ids is read twice."""
    import moefold.data.tokenizer
    import moefold.generate
    from moefold.cli import main

    builds, build = [], moefold.data.tokenizer.build_tokenizer

    def counted(*args, **kwargs):
        builds.append(args)
        return build(*args, **kwargs)
    monkeypatch.setattr(moefold.data.tokenizer, "build_tokenizer", counted)
    monkeypatch.setattr(moefold.generate, "build_tokenizer", counted)
    assert main(["generate", "--run-dir", str(two_step_run), "--prompt", "ab", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    assert len(builds) == 1, builds


class _Killed(Exception):
    pass


def test_generate_and_convert_say_the_config_toml_options_their_checkpoint_was_not_saved_with(
        two_step_run, tmp_path, monkeypatch, capsys):
    """After `--resume RUN --train.steps 4 --moe.top_k 3` killed before its first save, config.toml
    holds top_k 3 (and 4 steps) beside step 2's top_k-2 model. generate and convert use the
    checkpoint's (bae9d30) and said nothing, where `--resume RUN/checkpoints/step_2` says it in one
    line (b758f2c): now the same line on stderr, naming what each does. The text and the export are unchanged (stdout: the
    sample; the export's num_experts_per_tok stays 2)."""
    import json

    import moefold.train.trainer as trainer
    from moefold.cli import main

    def killed(*args, **kwargs):
        raise _Killed()
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "save_checkpoint", killed)
        with pytest.raises(_Killed):
            main(["train", "--resume", str(two_step_run), "--train.steps", "4", "--moe.top_k", "3"])
    prompt = ["--prompt", "ab", "--max-new-tokens", "3", "--device", "cpu", "--temperature", "0"]
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(two_step_run), *prompt]) == 0
    sampled = capsys.readouterr()
    held = f"note: {two_step_run / 'config.toml'} holds options its latest checkpoint was not saved with (a start " \
           "that saved none): moe.top_k=3, train.steps=4; "
    assert sampled.err.splitlines() == [held + "generate samples with its own: moe.top_k=2, train.steps=2"]
    assert main(["convert", "--run-dir", str(two_step_run), "--to-hf", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().err.splitlines() == [held + "convert exports its own: moe.top_k=2, train.steps=2"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_experts_per_tok"] == 2
    # A run whose config.toml its latest checkpoint was saved with says nothing.
    (two_step_run / "config.toml").write_text((two_step_run / "config.toml").read_text().replace(
        "\ntop_k = 3\n", "\ntop_k = 2\n").replace("\nsteps = 4\n", "\nsteps = 2\n"))
    assert main(["generate", "--run-dir", str(two_step_run), *prompt]) == 0
    assert capsys.readouterr() == (sampled.out, "")
