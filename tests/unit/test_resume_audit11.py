"""Which config a resumed checkpoint, `moefold generate` and `convert --to-hf` take: a checkpoint's
own for the model and training, config.toml's for the files outside it (data.path, data.tokenizer),
which a user who moved them sets there."""

import torch


def _model_state(checkpoint) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, saved)
    return torch.load(saved, weights_only=False)["model"]


def _set_in_config_toml(run, **data) -> None:
    """Edit [data] of run's config.toml as a user does after moving files."""
    from moefold.config import read_run_config, to_toml

    cfg, _ = read_run_config(run / "config.toml")
    for name, value in data.items():
        setattr(cfg.data, name, value)
    (run / "config.toml").write_text(to_toml(cfg))


def test_resume_of_a_checkpoint_finds_moved_data_where_config_toml_says(tmp_path, text_corpus, capsys):
    """The corpus moved and config.toml's data.path set to its new place: `--resume RUN` continued,
    but `--resume RUN/checkpoints/step_N` (the same latest checkpoint, or an older one to branch
    from) took the checkpoint's old path and stopped: 'data.path=OLD: no such file or directory'.
    The data checks (sequences, fingerprint) still say whether it is the data the checkpoint was
    trained on. The branch from step 2 is the original run: its step 4 equal bit for bit (CPU)."""
    from conftest import TINY_OVERRIDES, cli_args

    from moefold.cli import main
    from moefold.config import read_run_config

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *cli_args({
        **TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "4", "checkpoint.every": "2",
        "checkpoint.keep": "5"})]) == 0
    moved = text_corpus.rename(tmp_path / "moved")
    _set_in_config_toml(run, path=str(moved))
    branch = tmp_path / "branch"
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000002"), "--run-dir", str(branch)]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")] == []
    assert read_run_config(branch / "config.toml")[0].data.path == str(moved)
    original, branched = (_model_state(d / "checkpoints" / "step_00000004") for d in (run, branch))
    assert original.keys() == branched.keys()
    for name in original:
        assert torch.equal(original[name], branched[name]), name
    # Other data at config.toml's place is still refused, as `--resume RUN` refuses it.
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for doc in sorted(moved.iterdir())[:30]:
        (fewer / doc.name).write_bytes(doc.read_bytes())
    _set_in_config_toml(run, path=str(fewer))
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000002"),
                 "--run-dir", str(tmp_path / "other")]) == 2
    assert "a run continues with the data it was trained with" in capsys.readouterr().err


def test_generate_judges_token_files_at_config_toml_data_path(tmp_path, tiny_args, capsys):
    """generate refuses a run trained on a directory of token files of more ids than the byte tokenizer's without
    their tokenizer. With the files moved and config.toml's data.path set to their new place, it
    looked at the checkpoint's old path, found nothing ('no evidence') and printed the model's ids
    as bytes (exit 0)."""
    import numpy as np

    from moefold.cli import main

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(11, 1000, size=int(n)), 10) for n in rng.integers(20, 60, size=80)]
    (tmp_path / "tokens").mkdir()
    np.save(tmp_path / "tokens" / "part0.npy", np.concatenate(docs).astype(np.uint16))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--data.path", str(tmp_path / "tokens"),
                 "--data.eos_id", "10", "--model.vocab_size", "1000", "--train.steps", "1",
                 "--train.warmup_steps", "1"]) == 0
    moved = (tmp_path / "tokens").rename(tmp_path / "moved")
    _set_in_config_toml(run, path=str(moved))
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 2
    assert f"trained on token files (data.path={moved})" in capsys.readouterr().err


def test_resume_of_a_checkpoint_named_from_inside_its_run(tmp_path, text_corpus, monkeypatch, capsys):
    """`cd RUN/checkpoints && moefold train --resume step_00000002` (or `--resume .` inside the
    checkpoint) was refused: '--resume step_00000002: not a moefold run directory (no config.toml)',
    the path's parent read as written ('') rather than where it is. Now the same branch as the
    absolute path: its step 4 equal to the original's bit for bit (CPU)."""
    from conftest import TINY_OVERRIDES, cli_args

    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *cli_args({
        **TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "4", "checkpoint.every": "2",
        "checkpoint.keep": "5"})]) == 0
    monkeypatch.chdir(run / "checkpoints")
    assert main(["train", "--resume", "step_00000002", "--run-dir", "../../branch"]) == 0
    original, branched = (_model_state(d / "checkpoints" / "step_00000004") for d in (run, tmp_path / "branch"))
    for name in original:
        assert torch.equal(original[name], branched[name]), name
    monkeypatch.chdir(run / "checkpoints" / "step_00000002")
    capsys.readouterr()
    assert main(["train", "--resume", ".", "--run-dir", str(tmp_path / "other"), "--train.steps", "3"]) == 0
    assert f"(resumed from {run / 'checkpoints' / 'step_00000002'})" in capsys.readouterr().out


class _Killed(Exception):
    pass


def test_latest_checkpoint_named_or_by_its_run_after_a_resume_killed_before_saving(
        tmp_path, tiny_args, monkeypatch, capsys):
    """`--resume RUN --moe.top_k 3` killed before its first save leaves config.toml at top_k 3
    beside step 2's top_k-2 model. Naming step 2 continues with the config it was saved with: as
    `--resume RUN --moe.top_k 2` given explicitly, bit for bit (CPU), and says in one line the
    option of config.toml it does not take (silent before; train.steps, given, is not said).
    Naming the run takes config.toml (the latest start's options) and says the model it changes."""
    import moefold.train.trainer as trainer
    from moefold.cli import main
    from moefold.config import read_run_config

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1"]) == 0

    def killed(*args, **kwargs):
        raise _Killed()
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "save_checkpoint", killed)
        try:
            main(["train", "--resume", str(run), "--train.steps", "4", "--moe.top_k", "3"])
        except _Killed:
            pass
    assert read_run_config(run / "config.toml")[0].moe.top_k == 3
    capsys.readouterr()
    named, explicit, by_run = tmp_path / "named", tmp_path / "explicit", tmp_path / "by_run"
    step2 = run / "checkpoints" / "step_00000002"
    assert main(["train", "--resume", str(step2), "--run-dir", str(named), "--train.steps", "4"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")] == [
        f"note: {run / 'config.toml'} holds options its latest checkpoint was not saved with (a start that saved "
        f"none): moe.top_k=3; --resume {step2} continues with its own: moe.top_k=2"]
    assert main(["train", "--resume", str(run), "--run-dir", str(explicit), "--train.steps", "4",
                 "--moe.top_k", "2"]) == 0
    capsys.readouterr()
    assert read_run_config(named / "config.toml")[0] == read_run_config(explicit / "config.toml")[0]
    a, b = (_model_state(d / "checkpoints" / "step_00000004") for d in (named, explicit))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert main(["train", "--resume", str(run), "--run-dir", str(by_run), "--train.steps", "4"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: this run changes the model it resumes (compared with the config {step2} was saved "
                     "with): moe.top_k 2 -> 3"], notes
    assert read_run_config(by_run / "config.toml")[0].moe.top_k == 3
