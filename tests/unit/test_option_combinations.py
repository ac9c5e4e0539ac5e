"""Options that only mean something together with another: a value the rest of the config would
silently ignore, or one that validates but cannot train, is refused from the config with one line
naming it and what it needs. Found by a single-process sweep of option combinations on the tiny
presets (capacity, routers, balancing losses, MTP and chunked loss, recompute × offload × FP8 ×
optimizer precision, odd sizes)."""

import pytest
import torch
from torch import nn

from moefold.config import FP32_SMALLEST_NORMAL, OptimConfig, TrainConfig, load_config
from moefold.errors import ConfigError
from moefold.optim.adamw import build_optimizer


@pytest.mark.parametrize("eps", ["1e-300", "1e-46"])
def test_an_adamw_eps_that_fp32_rounds_to_zero_is_refused(eps):
    """Such an eps validated, then the second step divided 0 by 0 for every parameter without a
    gradient (an idle expert's rows) and the run stopped as 'diverged', blaming train.lr."""
    with pytest.raises(ConfigError, match=rf"^train.eps={eps} must be >= 1.2e-38 \(fp32's smallest normal"):
        load_config("tiny-qwen3", {"train.eps": eps})


@pytest.mark.parametrize("optim", [OptimConfig(), OptimConfig("bf16", "bf16"), OptimConfig("fp8", "fp8"),
                                   OptimConfig(master_dtype="bf16+remainder")])
def test_the_smallest_allowed_eps_keeps_a_parameter_without_gradient_finite(optim):
    load_config("tiny-qwen3", {"train.eps": str(FP32_SMALLEST_NORMAL)})
    model = nn.Linear(256, 2, bias=False)
    optimizer = build_optimizer(model, TrainConfig(eps=FP32_SMALLEST_NORMAL, weight_decay=0.0),
                                torch.device("cpu"), optim)
    for _ in range(2):
        model.weight.grad = torch.zeros_like(model.weight)
        optimizer.step()
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize("overrides, message", [
    # group_top_k was refused without groups; its sibling was silently dropped
    ({"moe.group_score_top_k": "2"}, "moe.group_score_top_k=2 needs moe.num_groups > 1"),
    ({"moe.shared_expert_gate": "true"}, "moe.shared_expert_gate=true needs moe.shared_experts > 0"),
    ({"moe.shared_expert_hidden": "24"}, "moe.shared_expert_hidden=24 needs moe.shared_experts > 0"),
])
def test_a_moe_option_without_the_feature_it_shapes_is_refused(overrides, message):
    """Each trained bit for bit as the run without it."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config("tiny-qwen3", overrides)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-deepseek", {"moe.shared_expert_gate": "true", "moe.shared_expert_hidden": "24"}),
    ("tiny-qwen3", {"moe.num_groups": "2", "moe.group_top_k": "1", "moe.group_score_top_k": "2"}),
])
def test_the_same_options_with_their_feature_validate(preset, overrides):
    load_config(preset, overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"model.q_lora_rank": "16"}, "model.q_lora_rank=16 needs model.attention='mla'"),
    ({"model.rope_interleaved": "true"}, "model.rope_interleaved=true needs model.attention='mla'"),
    ({"model.rope_factor": "4"}, "model.rope_factor=4.0 needs model.rope_scaling='yarn'"),
])
def test_an_attention_option_of_another_variant_is_refused(overrides, message):
    """MLA's and YaRN's options on a GQA model without scaling trained bit for bit as without them
    (model.sliding_window, GQA's own, was already refused under MLA)."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config("tiny-qwen3", overrides)


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-deepseek", {"model.rope_interleaved": "false", "model.q_lora_rank": "16"}),
    ("tiny-qwen3", {"model.rope_scaling": "yarn", "model.rope_factor": "4"}),
])
def test_the_same_attention_options_with_their_variant_validate(preset, overrides):
    load_config(preset, overrides)


@pytest.mark.parametrize("key", ["n_kv_heads", "head_dim"])
def test_gqa_head_sizes_under_mla_are_refused(key):
    """MLA sizes its heads with qk_nope/qk_rope/v_head_dim and gives every head its own keys and
    values: GQA's head sizes there trained as without them."""
    with pytest.raises(ConfigError, match=f"^model.{key}=4 needs model.attention='gqa'"):
        load_config("tiny-deepseek", {f"model.{key}": "4"})
    load_config("tiny-qwen3", {f"model.{key}": "4"})
