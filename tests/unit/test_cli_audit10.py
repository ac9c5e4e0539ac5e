"""`moefold train --resume CHECKPOINT` continues with the config that checkpoint was saved with, and
apply_recompute from Python refuses what the config refuses."""

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


def test_convert_to_hf_judges_the_checkpoint_whose_weights_it_exports(tmp_path, tiny_args, monkeypatch):
    """`convert --to-hf` resolved the run's latest checkpoint twice, as generate did: for the
    weights, then for the export's eos_token_id (none at step 0 of the byte tokenizer). A save in
    between had step 3 judged for step 2's weights."""
    import shutil
    from pathlib import Path

    import moefold.generate as generate
    from moefold.cli import main

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2",
                 "--train.warmup_steps", "1"]) == 0
    loaded, judged = [], []
    load_weights, checkpoint_step = generate.load_weights, generate.checkpoint_step

    def load_then_save_another(model, path, *args):
        load_weights(model, path, *args)
        loaded.append(path.name)
        shutil.copytree(path, path.with_name("step_00000003"))  # as a training's save meanwhile

    def step_of(path):
        judged.append(Path(path).name)
        return checkpoint_step(path)
    monkeypatch.setattr(generate, "load_weights", load_then_save_another)
    monkeypatch.setattr(generate, "checkpoint_step", step_of)
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "hf")]) == 0
    assert loaded == ["step_00000002"]
    assert judged == loaded
