"""The router against a per-token fp64 reference, over the grid of its variants."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from moefold.config import MoEConfig
from moefold.moe.balance import LoadBalancer
from moefold.moe.router import Router, build_router

D = 12


def make_router(cfg: MoEConfig, seed: int = 0, bias_scale: float = 0.0) -> Router:
    gen = torch.Generator().manual_seed(seed)
    router = build_router(D, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if router.expert_bias_E is not None:
            router.expert_bias_E.copy_(torch.randn(cfg.num_experts, generator=gen) * bias_scale)
    return router


def tokens(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def reference_route(x_TD, weight_ED, cfg: MoEConfig, bias_E=None):
    """Token by token in fp64, straight from the papers' descriptions."""
    E, K = cfg.num_experts, cfg.top_k
    bias_E = torch.zeros(E, dtype=torch.float64) if bias_E is None else bias_E.double()
    all_probs, all_idx = [], []
    for x_D in x_TD.double():
        logits_E = weight_ED.double() @ x_D
        scores_E = logits_E.sigmoid() if cfg.score_func == "sigmoid" else logits_E.softmax(-1)
        ranked_by = scores_E if cfg.softmax_before_topk else logits_E
        choice = [float(v) for v in ranked_by + bias_E]
        if cfg.num_groups > 1:
            size = E // cfg.num_groups
            group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:K // cfg.group_top_k])
                           for g in range(cfg.num_groups)]
            best = sorted(range(cfg.num_groups), key=lambda g: -group_score[g])[:cfg.group_top_k]
            choice = [c if e // size in best else -math.inf for e, c in enumerate(choice)]
        idx = sorted(range(E), key=lambda e: -choice[e])[:K]
        probs = scores_E[idx] if cfg.softmax_before_topk else logits_E[idx].softmax(-1)
        if cfg.norm_topk_prob:
            probs = probs / (probs.sum() + (1e-20 if cfg.score_func == "sigmoid" else 0.0))
        all_probs.append(probs * cfg.routed_scaling_factor)
        all_idx.append(torch.tensor(idx))
    return torch.stack(all_probs), torch.stack(all_idx)


def sorted_by_expert(probs_TK, idx_TK):
    idx_TK, order_TK = idx_TK.sort(dim=-1)
    return probs_TK.gather(-1, order_TK), idx_TK


SCORE_VARIANTS = [dict(score_func="softmax", softmax_before_topk=True),
                  dict(score_func="softmax", softmax_before_topk=False),
                  dict(score_func="sigmoid", softmax_before_topk=True)]
SHAPES = [dict(num_experts=8, top_k=3),
          dict(num_experts=16, top_k=4, num_groups=4, group_top_k=2)]
GRID = [(seed, *case) for seed, case in enumerate(itertools.product(
    range(len(SCORE_VARIANTS)), range(len(SHAPES)), [False, True], [False, True], ["fp32", "fp64"]))]


@pytest.mark.parametrize("seed, variant, shape, norm, bias, dtype", GRID)
def test_router_matches_per_token_reference(seed, variant, shape, norm, bias, dtype):
    scale = (1.0, 2.5)[seed % 3 == 0]
    cfg = MoEConfig(**SCORE_VARIANTS[variant], **SHAPES[shape], norm_topk_prob=norm,
                    routed_scaling_factor=scale, expert_bias=bias, router_dtype=dtype)
    router = make_router(cfg, seed=seed, bias_scale=0.3)
    x = tokens(24, seed=seed + 1)
    routing = router(x)
    probs_ref, idx_ref = reference_route(x, router.weight.detach(), cfg, router.expert_bias_E)

    probs, idx = sorted_by_expert(routing.probs_TK, routing.idx_TK)
    probs_ref, idx_ref = sorted_by_expert(probs_ref, idx_ref)
    assert torch.equal(idx, idx_ref)
    assert routing.idx_TK.dtype == torch.int64
    assert routing.probs_TK.dtype == routing.scores_TE.dtype == torch.float32
    assert routing.logits_TE.dtype == {"fp32": torch.float32, "fp64": torch.float64}[dtype]
    torch.testing.assert_close(probs, probs_ref.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", range(len(SCORE_VARIANTS)))
def test_balance_scores_are_a_distribution_over_all_experts(variant):
    cfg = MoEConfig(**SCORE_VARIANTS[variant], num_experts=8, top_k=2)
    router = make_router(cfg)
    x = tokens(10)
    routing = router(x)
    logits_TE = F.linear(x.double(), router.weight.double())
    expected = (logits_TE.sigmoid() / logits_TE.sigmoid().sum(-1, keepdim=True)
                if cfg.score_func == "sigmoid" else logits_TE.softmax(-1))
    torch.testing.assert_close(routing.scores_TE, expected.float())
    torch.testing.assert_close(routing.logits_TE, logits_TE.float())


def test_sigmoid_expert_bias_changes_selection_not_probs():
    cfg = MoEConfig(score_func="sigmoid", num_experts=8, top_k=2, norm_topk_prob=False,
                    expert_bias=True)
    router = make_router(cfg)
    x = tokens(16)
    unbiased = router(x)
    with torch.no_grad():
        router.expert_bias_E[5] = 10.0  # far above any sigmoid score: every token picks expert 5
    biased = router(x)
    assert (biased.idx_TK == 5).any(-1).all()
    assert not torch.equal(biased.idx_TK.sort(-1).values, unbiased.idx_TK.sort(-1).values)
    scores_TE = F.linear(x, router.weight).sigmoid()
    torch.testing.assert_close(biased.probs_TK, scores_TE.gather(-1, biased.idx_TK))
    assert (biased.probs_TK < 1).all()  # the bias of 10 is nowhere in the weights
    torch.testing.assert_close(biased.scores_TE, unbiased.scores_TE)


@pytest.mark.parametrize("groups", [0, 4])
def test_routing_saves_only_what_its_backward_reads(groups):
    """Choosing the experts builds no autograd graph: the only integer tensor the router saves for
    backward is idx_TK (the gather of the chosen weights). A selection on the differentiable
    scores saved the top-k indices and group masks of a graph that dies in forward, which
    memory.offload copied to the host."""
    cfg = MoEConfig(score_func="sigmoid", num_experts=8, top_k=2, expert_bias=True,
                    num_groups=groups, group_top_k=2 if groups else 0)
    router = make_router(cfg)
    x = tokens(16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        routing = router(x)
    integer = [t for t in saved if not t.is_floating_point()]
    assert len(integer) == 1 and integer[0] is routing.idx_TK


def test_router_without_expert_bias_has_no_buffer_and_ignores_updates():
    router = make_router(MoEConfig(num_experts=4, top_k=2))
    assert "expert_bias_E" not in router.state_dict()
    router.update_expert_bias(torch.tensor([9, 1, 1, 1]))
    assert router.expert_bias_E is None


def test_expert_bias_update_hand_checked():
    router = make_router(MoEConfig(num_experts=4, top_k=2, expert_bias=True,
                                   expert_bias_update_rate=0.1))
    # counts [10, 2, 5, 3]: mean 5, sign(mean - count) = [-1, +1, 0, +1], times the rate 0.1
    router.update_expert_bias(torch.tensor([10, 2, 5, 3]))
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.1, 0.1, 0.0, 0.1]))
    router.update_expert_bias(torch.tensor([10, 2, 5, 3]))
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([-0.2, 0.2, 0.0, 0.2]))
    assert router.state_dict()["expert_bias_E"].dtype == torch.float32


def test_the_expert_bias_stays_fp32_when_the_model_is_cast():
    """model.to(torch.bfloat16) casts the weight, not the bias: in bf16 an update of 1e-3 past 0.5
    is lost (8 bits of mantissa), and the bias would freeze."""
    router = make_router(MoEConfig(num_experts=4, top_k=2, expert_bias=True)).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias_E.dtype == torch.float32
    router.expert_bias_E.fill_(0.6)
    for _ in range(10):
        router.update_expert_bias(torch.tensor([100, 0, 0, 0]))
    torch.testing.assert_close(router.expert_bias_E, torch.tensor([0.59, 0.61, 0.61, 0.61]))


def test_force_balanced_gives_every_expert_the_same_load_and_keeps_gradients():
    cfg = MoEConfig(num_experts=8, top_k=2, force_balanced=True, norm_topk_prob=True)
    router = make_router(cfg)
    x = tokens(12)  # T·K = 24, 3 copies per expert
    routing = router(x)
    counts_E = torch.zeros(8, dtype=torch.int64).scatter_add_(
        0, routing.idx_TK.reshape(-1), torch.ones(24, dtype=torch.int64))
    assert counts_E.tolist() == [3] * 8
    assert routing.idx_TK[:5].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    scores_TE = F.linear(x, router.weight).softmax(-1).gather(-1, routing.idx_TK)
    torch.testing.assert_close(routing.probs_TK, scores_TE / scores_TE.sum(-1, keepdim=True))
    (routing.probs_TK * torch.randn(12, 2)).sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_jitter_only_in_training():
    cfg = MoEConfig(num_experts=3, top_k=1, input_jitter=0.1)
    router = build_router(1, cfg)
    with torch.no_grad():
        router.weight.fill_(1.0)
    x = torch.ones(200, 1)  # logits_TE = the noise itself, broadcast over the experts
    router.train()
    noise_T = router(x).logits_TE[:, 0]
    assert ((noise_T >= 0.9) & (noise_T <= 1.1)).all()
    assert noise_T.std() > 0.03  # uniform on a width 0.2 has std 0.058
    router.eval()
    assert torch.equal(router(x).logits_TE, torch.ones(200, 3))


def test_no_jitter_by_default_in_training():
    router = make_router(MoEConfig(num_experts=4, top_k=2)).train()
    x = tokens(8)
    assert torch.equal(router(x).logits_TE, router(x).logits_TE)


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_router_dtype_holds_under_autocast_and_low_precision_input(dtype):
    router = make_router(MoEConfig(num_experts=4, top_k=2, router_dtype=dtype))
    x = tokens(8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    expected = {"fp32": torch.float32, "fp64": torch.float64}[dtype]
    assert routing.logits_TE.dtype == expected
    torch.testing.assert_close(routing.logits_TE, F.linear(x.to(expected), router.weight.to(expected)))
    assert routing.probs_TK.dtype == torch.float32


@pytest.mark.parametrize("variant", [dict(score_func="softmax", softmax_before_topk=True),
                                     dict(score_func="softmax", softmax_before_topk=False),
                                     dict(score_func="sigmoid", routed_scaling_factor=2.5)])
def test_gradcheck_combine_weights_in_fp64(variant):
    cfg = MoEConfig(num_experts=6, top_k=2, norm_topk_prob=True, router_dtype="fp64", **variant)
    router = make_router(cfg)
    x_TD = tokens(5).double()
    idx_TK = router(x_TD).idx_TK  # the selection, then held fixed

    def probs(weight_ED):
        logits_TE = F.linear(x_TD, weight_ED)
        return router.combine_weights(logits_TE, router.score_fn.scores(logits_TE), idx_TK)

    weight = router.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(probs, (weight,))


@pytest.mark.parametrize("cfg", [
    MoEConfig(num_experts=16, top_k=4, num_groups=4, group_top_k=2, score_func="sigmoid",
              expert_bias=True, input_jitter=0.01, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01,
              global_aux_loss_coeff=0.01, z_loss_coeff=0.001),
    MoEConfig(num_experts=8, top_k=2, softmax_before_topk=False, force_balanced=True),
], ids=["grouped_sigmoid_bias", "force_balanced"])
def test_router_and_losses_never_need_values_on_the_host(cfg):
    """Under FakeTensorMode every data-dependent op (.item(), .tolist(), bincount, nonzero,
    masked_select, bool()) raises, so passing proves the path is sync-free."""
    router, balancer = make_router(cfg), LoadBalancer(cfg)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(8, D)
        routing = router.train()(x)
        total, _ = balancer(routing, 2, torch.ones(8, dtype=torch.bool))
        total.backward()
