"""The MoE layer against a per-token loop reference, and the aux-loss machinery."""

import pytest
import torch
import torch.nn.functional as F

from moefold.moe.dispatch import LocalDispatcher
from moefold.moe.experts import GroupedMMExperts, LoopExperts, grouped_mm_supported
from moefold.moe.layer import MoELayer
from moefold.moe.router import TopKRouter, switch_aux_loss

BACKENDS = [LoopExperts] + ([GroupedMMExperts] if grouped_mm_supported("cpu", torch.float32) else [])


def make_layer(backend, D=16, E=6, K=2, F_=12, norm_topk=True, aux_coeff=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(D, E, K, norm_topk)
    experts = backend(E, D, F_)
    with torch.no_grad():
        for p in (router.weight, experts.w1_EDF, experts.w3_EDF, experts.w2_EFD):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return MoELayer(router, experts, LocalDispatcher(K), aux_coeff)


def reference_moe(x_TD, layer: MoELayer):
    """Token by token: softmax router, top-k, optional renormalisation, weighted SwiGLU experts."""
    r, ex = layer.router, layer.experts
    out = []
    for x_D in x_TD:
        scores_E = (r.weight.double() @ x_D.double()).softmax(-1)
        probs_K, idx_K = scores_E.topk(r.top_k)
        if r.norm_topk_prob:
            probs_K = probs_K / probs_K.sum()
        y_D = 0
        for p, e in zip(probs_K, idx_K):
            h = F.silu(x_D.double() @ ex.w1_EDF[e].double()) * (x_D.double() @ ex.w3_EDF[e].double())
            y_D = y_D + p * (h @ ex.w2_EFD[e].double())
        out.append(y_D)
    return torch.stack(out)


def grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("K, norm_topk", [(1, False), (2, True), (3, False), (6, True)])
def test_forward_and_gradients_match_per_token_reference(backend, K, norm_topk):
    layer = make_layer(backend, K=K, norm_topk=norm_topk, seed=K)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = layer(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * upstream).sum().backward()

    ref_layer = make_layer(backend, K=K, norm_topk=norm_topk, seed=K)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference_moe(x_ref.view(-1, 16), ref_layer).view(2, 9, 16)
    (y_ref * upstream.double()).sum().backward()

    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads(layer, x), grads(ref_layer, x_ref)):
        torch.testing.assert_close(g, g_ref.to(g.dtype), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_experts_without_tokens_get_exact_zero_gradients(backend):
    layer = make_layer(backend, E=4, K=2)
    with torch.no_grad():  # inputs are positive, so experts 1 and 3 (negative rows) never win
        layer.router.weight[1] = -1.0
        layer.router.weight[3] = -2.0
    x = torch.rand(20, 16, requires_grad=True) + 0.1
    layer(x).square().sum().backward()
    for w in (layer.experts.w1_EDF, layer.experts.w3_EDF, layer.experts.w2_EFD):
        assert torch.isfinite(w.grad).all()
        assert w.grad[1].abs().sum() == 0 and w.grad[3].abs().sum() == 0
        assert w.grad[0].abs().sum() > 0 and w.grad[2].abs().sum() > 0


def test_backends_agree():
    if len(BACKENDS) < 2:
        pytest.skip("torch._grouped_mm unavailable on this build")
    x = torch.randn(50, 16)
    torch.testing.assert_close(make_layer(LoopExperts)(x), make_layer(GroupedMMExperts)(x))


def test_switch_aux_loss_hand_checked():
    scores_TE = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    counts_E = torch.tensor([3, 1])  # top-1 picks
    # f = [0.75, 0.25], P = [0.65, 0.35]: 2 · (0.75·0.65 + 0.25·0.35) = 1.15
    assert switch_aux_loss(scores_TE, counts_E, top_k=1).item() == pytest.approx(1.15)
    uniform = torch.full((8, 4), 0.25)
    assert switch_aux_loss(uniform, torch.tensor([4, 4, 4, 4]), top_k=2).item() == pytest.approx(1.0)


def test_injected_aux_loss_gradient_equals_adding_it_to_the_loss():
    coeff = 0.37
    layer = make_layer(LoopExperts, aux_coeff=coeff)
    x = torch.randn(30, 16)
    layer(x).sum().backward()
    injected = layer.router.weight.grad.clone()

    plain = make_layer(LoopExperts, aux_coeff=0.0)
    routing = plain.router(x)
    y = plain(x)
    (y.sum() + coeff * routing.aux_loss).backward()
    torch.testing.assert_close(injected, plain.router.weight.grad)


def test_stats_count_every_routed_copy():
    layer = make_layer(LoopExperts, E=6, K=2)
    layer(torch.randn(10, 16))
    layer(torch.randn(7, 16))
    counts_E, mean_aux = layer.pop_stats()
    assert counts_E.sum().item() == (10 + 7) * 2
    assert mean_aux.item() > 0
    assert layer.pop_stats()[0].sum().item() == 0
