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
