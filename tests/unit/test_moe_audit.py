"""Audit of the MoE layer's routing and token handling against independent references: Hugging Face
transformers' own MoE blocks (DeepSeek-V3, Qwen3-MoE, Mixtral) fed the same weights, naive per-token
loops of the capacity rule and the balancing losses (Switch, DeepSeek-V3, ST-MoE), and the edges
(top_k = num_experts, ties, one expert taking every token, bad option values)."""

import math

import pytest
import torch

from moefold.config import MoEConfig
from moefold.errors import ConfigError
from moefold.moe.capacity import build_capacity
from moefold.moe.layer import build_moe_layer

D, F = 16, 8


# ------------------------------------------------------------------------------ bad option values


@pytest.mark.parametrize("key, value", [
    ("routed_scaling_factor", math.inf), ("capacity_factor", math.inf), ("aux_loss_coeff", math.inf),
    ("expert_bias_update_rate", math.inf), ("seq_aux_loss_coeff", math.inf), ("num_experts", 2**64),
])
def test_a_layer_built_in_python_refuses_what_load_config_refuses(key, value):
    """build_moe_layer checks a MoEConfig 'as load_config does' (docs/python.md); load_config refuses
    nan, ±inf and integers past 64 bits. routed_scaling_factor=inf built a layer whose every output
    was NaN, capacity_factor=inf one whose first forward raised 'Invalid literal for Fraction'."""
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden": F, "expert_bias": True, key: value})
    with pytest.raises(ConfigError, match=rf"^moe\.{key}={value} must be "):
        build_moe_layer(D, cfg, "cpu", torch.float32)
