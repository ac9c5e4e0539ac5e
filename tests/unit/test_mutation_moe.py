"""Tests found by mutation testing of moe/ and train/loss: each kills a change to the source that
every other unit test let through, by comparing with an independent naive reference."""

import pytest
import torch

from moefold.config import MoEConfig
from moefold.moe.layer import build_moe_layer
from moefold.moe.router import build_router


def test_jitter_noise_is_centred_uniform_over_one_plus_minus_eps():
    """Switch Transformer's U(1-eps, 1+eps): centred on 1 and spanning both sides (a U(1, 1+eps)
    scaled every input up by eps/2 on average, and passed the range-and-spread test)."""
    eps = 0.1
    router = build_router(1, MoEConfig(num_experts=2, top_k=1, input_jitter=eps)).train()
    with torch.no_grad():
        router.weight.fill_(1.0)
    torch.manual_seed(0)
    noise_T = router(torch.ones(4000, 1)).logits_TE[:, 0].double()
    assert abs(noise_T.mean().item() - 1.0) < 0.005  # uniform mean 1; its sample std is 0.0009
    assert noise_T.min().item() < 1.0 - 0.98 * eps and noise_T.max().item() > 1.0 + 0.98 * eps
    assert abs(noise_T.std().item() - 2 * eps / 12 ** 0.5) < 0.003


def naive_group_limited_topk(selection_E: list[float], num_groups: int, group_top_k: int,
                             per_group_score: int, top_k: int) -> list[int]:
    """One token, DeepSeek-V3 / Megatron node-limited routing, in plain Python."""
    size = len(selection_E) // num_groups
    groups = [selection_E[g * size:(g + 1) * size] for g in range(num_groups)]
    group_score = [sum(sorted(group, reverse=True)[:per_group_score]) for group in groups]
    kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_top_k]
    allowed = [e for e in range(len(selection_E)) if e // size in kept]
    return sorted(sorted(allowed, key=lambda e: -selection_E[e])[:top_k])


@pytest.mark.parametrize("top_k, group_top_k, group_score_top_k, per_group_score",
                         [(6, 2, 0, 3), (2, 2, 0, 1), (4, 2, 1, 1), (4, 2, 3, 3)])
def test_group_scores_sum_the_configured_number_of_experts(top_k, group_top_k, group_score_top_k,
                                                           per_group_score):
    """A group's score sums its top group_score_top_k experts, 0 meaning top_k // group_top_k
    (Megatron); the router grid only had top_k // group_top_k = 2, DeepSeek-V3's fixed count."""
    cfg = MoEConfig(num_experts=16, top_k=top_k, num_groups=4, group_top_k=group_top_k,
                    group_score_top_k=group_score_top_k, score_func="sigmoid")
    router = build_router(8, cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 8, generator=gen))
    x_TD = torch.randn(64, 8, generator=gen)
    scores_TE = torch.sigmoid(x_TD.double() @ router.weight.detach().double().T)
    idx_TK = router(x_TD).idx_TK.sort(dim=-1).values
    differs = 0
    for t, scores_E in enumerate(scores_TE.tolist()):
        expected = naive_group_limited_topk(scores_E, 4, group_top_k, per_group_score, top_k)
        assert idx_TK[t].tolist() == expected
        differs += expected != naive_group_limited_topk(scores_E, 4, group_top_k, 2, top_k)
    assert differs > 0  # the tokens tell this count from the top-2 sum


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_aux_losses_reach_the_router_weighted_by_coefficient_and_micro_batch_scale(scale):
    """A training forward adds aux_loss_scale · Σ coeff · loss to the objective (the trainer's
    1 / grad_accum): the router's gradient is the evaluation forward's plus that of a naive
    Switch loss and z-loss, scaled. (A backward that sent 1 in place of the scale passed.)"""
    E, K, D, T = 6, 2, 8, 20
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=12, aux_loss_coeff=0.3, z_loss_coeff=0.05,
                    router_dtype="fp64")
    layer = build_moe_layer(D, cfg, "cpu", torch.float64).double()
    gen = torch.Generator().manual_seed(0)
    for weight in layer.parameters():  # build_moe_layer leaves them uninitialised (torch.empty)
        torch.nn.init.normal_(weight, std=0.5, generator=gen)
    x_BSD = torch.randn(2, T // 2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def router_grad(training: bool, extra=lambda: 0.0):
        layer.zero_grad()
        layer.train(training)
        layer.aux_loss_scale = scale
        (layer(x_BSD).sum() + extra()).backward()
        return layer.router.weight.grad.clone()

    def naive_aux():
        logits_TE = x_BSD.reshape(T, D) @ layer.router.weight.T
        idx_TK = logits_TE.softmax(-1).topk(K, dim=-1).indices
        f_E = torch.stack([(idx_TK == e).sum() for e in range(E)]).double() / (T * K)
        aux = E * (f_E * logits_TE.softmax(-1).mean(0)).sum()
        z = (torch.logsumexp(logits_TE, -1) ** 2).mean()
        return scale * (0.3 * aux + 0.05 * z)

    # the aux losses see the scores in fp32 (Routing.scores_TE)
    torch.testing.assert_close(router_grad(True), router_grad(False, naive_aux), rtol=1e-5, atol=1e-6)
