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
from moefold.moe.stats import ExpertLoadStats

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



# --------------------------------------------------------------- transformers' DeepSeek routers


def _deepseek_v3_hf_router(E, G, group_top_k, K, norm, scale, bias_scale, gen):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=group_top_k,
        norm_topk_prob=norm, routed_scaling_factor=scale))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, D, generator=gen))
        hf.e_score_correction_bias.copy_((torch.rand(E, generator=gen) - 0.5) * bias_scale)
    return hf


def _deepseek_v3_cases():
    """(E, G, group_top_k, K): groups of at least 2 experts (transformers scores a group by its
    top 2), K no more than the kept groups hold; G = 1 and group_top_k = G among them."""
    for E, G, group_top_k, K in itertools.product((8, 16, 32), (1, 2, 4, 8), (1, 2, 4), (1, 2, 3, 6, 8)):
        if E % G == 0 and E // G >= 2 and group_top_k <= G and K <= group_top_k * E // G:
            yield E, G, group_top_k, K


@pytest.mark.parametrize("bias_scale", [0.0, 0.3, 3.0])
def test_sigmoid_grouped_routing_chooses_and_weighs_as_transformers_deepseek_v3(bias_scale):
    """Every (E, groups, kept groups, K) above, renormalised or not, scaled or not, with no bias,
    a small one and one that dwarfs the sigmoid scores (some negative): the same experts and
    weights as transformers' DeepseekV3TopkRouter, whose n_group=1 is moefold's ungrouped top-k."""
    checked = 0
    for case, norm in itertools.product(_deepseek_v3_cases(), (True, False)):
        E, G, group_top_k, K = case
        scale = 2.5 if K % 2 else 1.0
        gen = torch.Generator().manual_seed(hash((case, norm, bias_scale)) % 2**31)
        hf = _deepseek_v3_hf_router(E, G, group_top_k, K, norm, scale, bias_scale, gen)
        grouped = dict(num_groups=G, group_top_k=group_top_k, group_score_top_k=2) if G > 1 else {}
        router = build_router(D, MoEConfig(num_experts=E, top_k=K, score_func="sigmoid", norm_topk_prob=norm,
                                           routed_scaling_factor=scale, expert_bias=True, **grouped))
        with torch.no_grad():
            router.weight.copy_(hf.weight)
            router.expert_bias_E.copy_(hf.e_score_correction_bias)
        x_TD = torch.randn(32, D, generator=gen)
        _, probs_hf_TK, idx_hf_TK = hf(x_TD)
        routing = router(x_TD)
        idx_TK, order_TK = routing.idx_TK.sort(-1)
        idx_hf_sorted_TK, order_hf_TK = idx_hf_TK.sort(-1)
        assert torch.equal(idx_TK, idx_hf_sorted_TK), (case, norm)
        torch.testing.assert_close(routing.probs_TK.gather(-1, order_TK), probs_hf_TK.gather(-1, order_hf_TK),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} norm={norm}: {m}")
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("E, G, group_top_k, K", [(16, 4, 2, 4), (16, 8, 3, 6), (64, 8, 3, 6), (8, 2, 1, 2)])
def test_softmax_group_limited_greedy_is_transformers_deepseek_v2(E, G, group_top_k, K):
    """DeepSeek-V2's group_limited_greedy (softmax, a group scored by its best expert, weights
    not renormalised, times routed_scaling_factor) is moefold's softmax router with
    group_score_top_k=1 and norm_topk_prob=false."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf = DeepseekV2TopkRouter(DeepseekV2Config(
        hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=group_top_k,
        topk_method="group_limited_greedy", routed_scaling_factor=16.0, num_attention_heads=2,
        num_key_value_heads=2))
    gen = torch.Generator().manual_seed(E + G + K)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, D, generator=gen))
    router = build_router(D, MoEConfig(num_experts=E, top_k=K, num_groups=G, group_top_k=group_top_k,
                                       group_score_top_k=1, norm_topk_prob=False, routed_scaling_factor=16.0))
    with torch.no_grad():
        router.weight.copy_(hf.weight)
    x_TD = torch.randn(256, D, generator=gen)
    _, probs_hf_TK, idx_hf_TK = hf(x_TD)
    routing = router(x_TD)
    idx_TK, order_TK = routing.idx_TK.sort(-1)
    idx_hf_sorted_TK, order_hf_TK = idx_hf_TK.sort(-1)
    assert torch.equal(idx_TK, idx_hf_sorted_TK)
    torch.testing.assert_close(routing.probs_TK.gather(-1, order_TK), probs_hf_TK.gather(-1, order_hf_TK))
    # the tokens tell a group's best expert from the top-2 sum moefold's default would take
    default = build_router(D, MoEConfig(num_experts=E, top_k=K, num_groups=G, group_top_k=group_top_k,
                                        group_score_top_k=2, norm_topk_prob=False))
    with torch.no_grad():
        default.weight.copy_(hf.weight)
    assert not torch.equal(default(x_TD).idx_TK.sort(-1).values, idx_TK)


# ------------------------------------------------------------------ load-balancing loss, HF's


@pytest.mark.parametrize("E, K", [(8, 2), (4, 1), (16, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_micro_batch_loss_is_transformers_load_balancing_loss_over_k(E, K, masked):
    """transformers' load_balancing_loss_func (Qwen3-MoE, Mixtral) over one layer's logits, with
    and without an attention mask, is K times moefold's aux loss: it divides the copies by the
    tokens, moefold by the tokens' K copies (Switch/Megatron-Core), so even routing is 1.0 for any
    K (docs/architecture.md). The value and the router's gradient, through the layer's balancer."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from moefold.moe.balance import LoadBalancer

    B, S = 3, 7
    gen = torch.Generator().manual_seed(E * K)
    weight_ED = torch.randn(E, D, generator=gen, dtype=torch.float64, requires_grad=True)
    x_TD = torch.randn(B * S, D, generator=gen, dtype=torch.float64)
    mask_BS = (torch.rand(B, S, generator=gen) > 0.3).long() if masked else None
    router = build_router(D, MoEConfig(num_experts=E, top_k=K, router_dtype="fp64"))
    with torch.no_grad():
        router.weight.copy_(weight_ED)
    routing = router(x_TD)
    valid_T = None if mask_BS is None else mask_BS.bool().view(-1)
    ours, _ = LoadBalancer(MoEConfig(num_experts=E, top_k=K, aux_loss_coeff=1.0))(routing, B, valid_T)
    theirs = load_balancing_loss_func((x_TD @ weight_ED.T,), E, K, mask_BS)
    torch.testing.assert_close(K * ours.double(), theirs.double(), rtol=1e-6, atol=0)
    grad_ours, = torch.autograd.grad(K * ours, router.weight)
    grad_theirs, = torch.autograd.grad(theirs, weight_ED)
    torch.testing.assert_close(grad_ours, grad_theirs.to(grad_ours), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ capacity


def _routed(T, E, K, seed):
    """Distinct probabilities (no ties for a reference to break its own way) and skewed logits, so
    that some experts overflow."""
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=gen) + torch.linspace(0, 2, E)
    probs_TK, idx_TK = logits_TE.softmax(-1).topk(K)
    return probs_TK, idx_TK


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_drop_by_probs_keeps_each_experts_top_c_as_megatron_core(seed, factor):
    """Megatron-Core's apply_router_token_dropping (drop_policy probs): per expert, the C tokens of
    highest routing probability over the [T, E] map, C = ceil(T·K·factor / E); a copy is kept
    where it is one of those."""
    T, E, K = 24 + seed, 8, 1 + seed % 3
    probs_TK, idx_TK = _routed(T, E, K, seed)
    C = math.ceil(T * K * factor / E)
    probs_TE = torch.zeros(T, E).scatter(1, idx_TK, probs_TK)
    routed_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx_TK, True)
    top_c_TE = torch.zeros(T, E, dtype=torch.bool).scatter(0, probs_TE.topk(C, dim=0).indices, True)
    expected_TK = (top_c_TE & routed_TE).gather(1, idx_TK)
    keep_TK = build_capacity(E, factor, "probs")(idx_TK, probs_TK).view(T, K)
    assert torch.equal(keep_TK, expected_TK)
    assert not keep_TK.all()  # the case drops something


@pytest.mark.parametrize("seed", range(9))
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_drop_by_position_keeps_each_experts_earliest_tokens_as_switch_and_megatron_core(seed, factor):
    """Switch Transformer's position in an expert's buffer: the cumulative sum of the [T, E] routing
    map over the tokens before it, kept below C; Megatron-Core's drop_policy=position keeps the
    same C earliest tokens of each expert for any K. (GShard's top-2 instead ranks every token's
    first choice before any second choice: another order.)"""
    T, E, K = 30 + seed, 4, 1 + seed % 3
    probs_TK, idx_TK = _routed(T, E, K, seed)
    routed_TE = torch.zeros(T, E, dtype=torch.long).scatter(1, idx_TK, 1)
    position_TE = (routed_TE.cumsum(0) - 1) * routed_TE
    expected_TK = (position_TE < math.ceil(T * K * factor / E)).gather(1, idx_TK)
    keep_TK = build_capacity(E, factor, "position")(idx_TK, probs_TK).view(T, K)
    assert torch.equal(keep_TK, expected_TK)
    assert not keep_TK.all()
