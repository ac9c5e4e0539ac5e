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
