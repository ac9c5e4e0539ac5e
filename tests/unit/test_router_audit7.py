"""Audit 7 of the router, the balancing losses, capacity and the load statistics, each against an
independent reference: Hugging Face transformers' routers and load-balancing loss, DeepSeek-V3's
expert-bias rule in exact integer arithmetic, Switch Transformer's position-in-expert cumsum, a
Megatron-Core-style per-expert top-C of the probabilities, and naive counts."""

import itertools
import math

import pytest
import torch

from moefold.config import MoEConfig
from moefold.moe.capacity import build_capacity
from moefold.moe.router import build_router
from moefold.moe.stats import ExpertLoadStats, summarize

D = 16


# ------------------------------------------------------------------ expert bias (aux-loss-free)


def paper_bias_step(load_E: list[int], rate: float) -> list[float]:
    """DeepSeek-V3 §2.1.2 in Python integers: +rate where the expert is under the mean load, -rate
    where over it, 0 where equal (mean − load has the sign of Σ load − E·load)."""
    total, E = sum(load_E), len(load_E)
    return [rate * ((total > E * load) - (total < E * load)) for load in load_E]


def one_over(num_experts: int, load: int) -> list[int]:
    """Every expert at `load` but the last, one copy over it: the mean is load + 1/E."""
    return [load] * (num_experts - 1) + [load + 1]


@pytest.mark.parametrize("load_E", [
    one_over(256, 2_000_000),  # DeepSeek-V3's 256 experts at ~2M copies each (15M tokens a step, K=8)
    one_over(64, 300_000),
    [2**24 + 1, 2**24 - 1, 2**24],  # past fp32's exact integers: the first is over the mean
    [5, 2, 3],  # small loads, a mean of 10/3
], ids=["256x2M", "64x300k", "past-2**24", "small"])
def test_the_bias_step_compares_each_load_with_the_exact_mean(load_E):
    """b_e += rate · sign(mean load − load_e) with the exact mean. In fp32 a mean of 255 experts at
    2M copies and one at 2M + 1 rounds to 2M: the 255 experts under the mean took no step."""
    router = build_router(D, MoEConfig(num_experts=len(load_E), top_k=1, expert_bias=True,
                                       expert_bias_update_rate=0.5))
    router.update_expert_bias(torch.tensor(load_E))
    assert router.expert_bias_E.tolist() == paper_bias_step(load_E, 0.5)


# ------------------------------------------------------------------------------ statistics


def test_an_aux_value_named_like_a_summary_key_is_refused():
    """summarize logs `<name>_per_layer` for each aux value, and `tokens_per_expert_per_layer` is
    its own key (the heatmap's counts): an aux value named tokens_per_expert had its per-layer
    list silently replaced by the counts."""
    stats = ExpertLoadStats(4)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        stats.record(torch.tensor([1, 2, 3, 4]), torch.full((5, 4), 0.25), 0,
                     {"tokens_per_expert": torch.tensor(0.5)})
    with pytest.raises(ValueError, match="tokens_per_expert"):
        ExpertLoadStats(4, aux_names=("tokens_per_expert",))

