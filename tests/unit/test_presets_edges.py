"""Edges of the presets and of what is built and counted from them: configs of very many layers,
and the families without a Hugging Face conversion against transformers' own models."""

import time

import pytest

from moefold.config import load_config


@pytest.mark.parametrize("preset, overrides", [
    ("deepseek-v3", {}),
    ("tiny", {"memory.recompute": '["mlp", "moe_act"]'}),  # the checks that ask for dense / MoE layers
    ("tiny", {"moe.first_k_dense": "0", "moe.dense_layers": "[99999999]", "memory.recompute": '["mlp"]'}),
])
def test_a_config_of_very_many_layers_validates_without_visiting_each(preset, overrides):
    """`config params` and `plan memory` count a 10^8-layer model from one block of each kind; the
    config's own checks (is there a dense MLP, a shared expert to split over TP, ...) must not
    visit each layer either (they did, in 2 lists of 10^8: minutes before any output)."""
    start = time.perf_counter()
    cfg = load_config(preset, {"model.n_layers": "100000000", **overrides})
    assert time.perf_counter() - start < 2
    assert cfg.model.n_layers == 10**8


def test_a_dense_layer_of_very_many_is_found():
    """The one dense layer among 10^8 MoE layers still makes 'mlp' a site memory.recompute can
    wrap; with none, it is refused as before."""
    layers = {"model.n_layers": "100000000", "moe.first_k_dense": "0", "memory.recompute": '["mlp"]'}
    load_config("tiny", {**layers, "moe.dense_layers": "[99999999]"})
    with pytest.raises(Exception, match="no dense MLP layer"):
        load_config("tiny", layers)
