"""`moefold train --resume CHECKPOINT` continues with the config that checkpoint was saved with, and
apply_recompute from Python refuses what the config refuses."""

import contextlib

import pytest
import torch

from moefold.config import ConfigError, load_config


def test_recompute_from_python_of_a_name_the_model_offloads_is_refused_as_the_config_does():
    """apply_recompute took 'norm' after apply_offload(model, ['norm']) (the config refuses the
    pair: a recomputed site keeps no activations to offload); the host copies still moved
    462,848 B per tiny forward. Now the config's one-line message."""
    from moefold.memory.offload import apply_offload
    from moefold.memory.recompute import apply_recompute
    from moefold.models.transformer import build_model

    with pytest.raises(ConfigError) as by_config:
        load_config("tiny", {"memory.recompute": '["norm"]', "memory.offload": '["norm"]'})
    with torch.device("meta"):
        model = build_model(load_config("tiny"), 256)
    apply_offload(model, ["norm"], 0, "cpu")
    with pytest.raises(ConfigError) as by_call:
        apply_recompute(model, ["norm"])
    assert str(by_call.value) == str(by_config.value)
    assert "norm is also recomputed" in str(by_call.value)
    apply_recompute(model, ["attn_core"])  # a name it does not offload still wraps
    assert model.recomputed_names == ["attn_core"]


def _run_to_4_then_resumed_with_top_k_3(tmp_path, text_corpus, monkeypatch=None):
    """A run of moe.top_k 2 to step 4 (checkpoints 2 and 4), then resumed to step 6 with --moe.top_k
    3, which its config.toml then holds. With `monkeypatch`, its first checkpoints hold no config
    (as an earlier moefold saved them)."""
    from conftest import TINY_OVERRIDES, cli_args

    import moefold.train.trainer as trainer
    from moefold.cli import main

    run = tmp_path / "run"
    args = cli_args({**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "4",
                     "checkpoint.every": "2", "checkpoint.keep": "5"})
    with monkeypatch.context() if monkeypatch else contextlib.nullcontext() as patch:
        if patch:
            patch.setattr(trainer, "CONFIG_KEY", "not_the_config")  # saved under another key: none found
        assert main(["train", "--run-dir", str(run), *args]) == 0
    assert main(["train", "--resume", str(run), "--train.steps", "6", "--moe.top_k", "3"]) == 0
    return run


def _model_state(checkpoint) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, saved)
    return torch.load(saved, weights_only=False)["model"]


def test_resume_from_a_checkpoint_continues_with_the_config_it_was_saved_with(tmp_path, text_corpus, capsys):
    """--resume CHECKPOINT read its run's config.toml, which a later resume had rewritten: the
    branch from step 2 trained moe.top_k 3 to step 6 (that resume's options) from a checkpoint of
    top_k 2, with a note. Megatron-LM's --use-checkpoint-args, and a user rolling back to an
    earlier checkpoint, expect the options that checkpoint was trained with: the branch is now
    the original run from step 2, its step 4 equal to the original's bit for bit (CPU)."""
    from moefold.cli import main
    from moefold.config import read_run_config

    run = _run_to_4_then_resumed_with_top_k_3(tmp_path, text_corpus)
    branch = tmp_path / "branch"
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000002"), "--run-dir", str(branch)]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")] == []
    cfg, _ = read_run_config(branch / "config.toml")
    assert (cfg.moe.top_k, cfg.train.steps) == (2, 4)
    original, branched = _model_state(run / "checkpoints" / "step_00000004"), _model_state(
        branch / "checkpoints" / "step_00000004")
    assert original.keys() == branched.keys()
    for name in original:
        assert torch.equal(original[name], branched[name]), name
    # An option given still changes it, and is said to change the model the checkpoint holds.
    assert main(["train", "--resume", str(run / "checkpoints" / "step_00000002"), "--run-dir",
                 str(tmp_path / "other"), "--moe.top_k", "3"]) == 0
    assert (f"note: this run changes the model it resumes (compared with the config {run}/checkpoints/step_00000002 "
            "was saved with): moe.top_k 2 -> 3") in capsys.readouterr().out


def test_resume_from_an_older_checkpoint_without_its_config_says_whose_options_it_takes(
        tmp_path, text_corpus, capsys, monkeypatch):
    """A checkpoint saved before moefold recorded its config (or a weights-only one) continues with
    config.toml, as before; where a later checkpoint exists the options may be a later resume's,
    which the run now says in one line."""
    from moefold.cli import main
    from moefold.config import read_run_config

    run = _run_to_4_then_resumed_with_top_k_3(tmp_path, text_corpus, monkeypatch)
    step2 = run / "checkpoints" / "step_00000002"
    capsys.readouterr()
    assert main(["train", "--resume", str(step2), "--run-dir", str(tmp_path / "branch")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: --resume {step2} holds no config of its own (weights only, or saved by an earlier "
                     f"moefold): continuing with {run / 'config.toml'}, the options of the run's latest start, "
                     "which may differ from those it was saved with"]
    assert read_run_config(tmp_path / "branch" / "config.toml")[0].moe.top_k == 3
