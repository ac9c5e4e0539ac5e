"""The whole MoE layer against a per-token loop reference over randomized configurations.

The reference routes, drops and computes one token at a time in fp64, straight from the definitions:
nothing is shared with the implementation but the weights.
"""

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

from moefold.config import MoEConfig
from moefold.moe.experts import grouped_mm_supported
from moefold.moe.layer import build_moe_layer

BACKENDS = ["loop"] + (["grouped_mm"] if grouped_mm_supported("cpu", torch.float32) else [])
ACT = {"swiglu": lambda g, u: F.silu(g) * u, "gelu": F.gelu, "relu2": lambda h: F.relu(h) ** 2}


def random_config(seed: int) -> MoEConfig:
    rng = random.Random(seed)
    E = rng.choice([4, 8, 16])
    cfg = MoEConfig(num_experts=E, top_k=rng.randint(1, min(8, E)), expert_hidden=rng.choice([8, 12]),
                    score_func=rng.choice(["softmax", "sigmoid"]), norm_topk_prob=rng.random() < 0.5,
                    routed_scaling_factor=rng.choice([1.0, 2.5]), aux_loss_coeff=0.0,
                    expert_bias=rng.random() < 0.3, activation=rng.choice(["swiglu", "gelu", "relu2"]),
                    memory_efficient_permute=rng.random() < 0.5, pad_multiple=rng.choice([0, 0, 8, 16]),
                    shared_experts=rng.choice([0, 0, 1, 2]), shared_expert_gate=rng.random() < 0.5,
                    router_dtype=rng.choice(["fp32", "fp64"]),
                    experts_backend="loop")  # fp64: grouped_mm has no CPU fp64 kernel
    if cfg.score_func == "softmax":
        cfg.softmax_before_topk = rng.random() < 0.7
    if E >= 8 and rng.random() < 0.4:
        cfg.num_groups, cfg.group_top_k = 4, 2
        cfg.top_k = rng.choice([2, 4])
    if rng.random() < 0.4:
        cfg.capacity_factor = rng.choice([0.5, 1.0, 1.25])
        cfg.drop_policy = rng.choice(["probs", "position"])
        cfg.pad_to_capacity = rng.random() < 0.5
    return cfg


def build(cfg: MoEConfig, dim: int, seed: int):
    layer = build_moe_layer(dim, cfg, "cpu", torch.float32).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.4)
        if cfg.expert_bias:
            layer.router.expert_bias_E.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.1)
    return layer


# ----------------------------------------------------------------------------- the reference


def ref_route(x_D, layer, cfg: MoEConfig):
    """(experts, probs) for one token, from the definitions."""
    logits_E = layer.router.weight @ x_D
    bias_E = layer.router.expert_bias_E.double() if cfg.expert_bias else torch.zeros_like(logits_E)
    if cfg.score_func == "sigmoid":
        scores_E = torch.sigmoid(logits_E)
        select_E = scores_E + bias_E
    else:
        scores_E = logits_E.softmax(-1)
        select_E = (scores_E if cfg.softmax_before_topk else logits_E) + bias_E
    if cfg.num_groups > 1:
        per_group = cfg.num_experts // cfg.num_groups
        group_score = [sorted(select_E[g * per_group:(g + 1) * per_group].tolist(), reverse=True)
                       [:cfg.top_k // cfg.group_top_k] for g in range(cfg.num_groups)]
        best = sorted(range(cfg.num_groups), key=lambda g: -sum(group_score[g]))[:cfg.group_top_k]
        allowed = [e for e in range(cfg.num_experts) if e // per_group in best]
    else:
        allowed = list(range(cfg.num_experts))
    chosen = sorted(allowed, key=lambda e: -select_E[e].item())[:cfg.top_k]
    if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
        probs = logits_E[chosen].softmax(-1)
    else:
        probs = scores_E[chosen]
    if cfg.norm_topk_prob:
        probs = probs / (probs.sum() + (1e-20 if cfg.score_func == "sigmoid" else 0.0))
    return chosen, probs * cfg.routed_scaling_factor


def ref_kept(routes, cfg: MoEConfig, num_tokens: int):
    """The set of (token, k) copies each expert keeps under the capacity rule."""
    copies = [(t, k, e, p) for t, (experts, probs) in enumerate(routes) for k, (e, p) in
              enumerate(zip(experts, probs))]
    if cfg.capacity_factor <= 0:
        return {(t, k) for t, k, _, _ in copies}
    capacity = math.ceil(cfg.capacity_factor * num_tokens * cfg.top_k / cfg.num_experts)
    kept = set()
    for expert in range(cfg.num_experts):
        mine = [(t, k, p) for t, k, e, p in copies if e == expert]
        if cfg.drop_policy == "probs":
            mine.sort(key=lambda c: -c[2].item())
        kept |= {(t, k) for t, k, _ in mine[:capacity]}
    return kept


def ref_expert(x_D, layer, e, act):
    ex = layer.experts
    h = act(x_D @ ex.w1_EDF[e], x_D @ ex.w3_EDF[e]) if hasattr(ex, "w3_EDF") else act(x_D @ ex.w1_EDF[e])
    return h @ ex.w2_EFD[e]


def ref_shared(x_D, layer, act):
    s = layer.shared
    h = act(s.w1(x_D), s.w3(x_D)) if hasattr(s, "w3") else act(s.w1(x_D))
    out = s.w2(h)
    return torch.sigmoid(s.gate(x_D)) * out if hasattr(s, "gate") else out


def reference_layer(x_TD, layer, cfg: MoEConfig):
    act = ACT[cfg.activation]
    routes = [ref_route(x_D, layer, cfg) for x_D in x_TD]
    kept = ref_kept(routes, cfg, len(x_TD))
    out = []
    for t, (x_D, (experts, probs)) in enumerate(zip(x_TD, routes)):
        y_D = torch.zeros_like(x_D)
        for k, (e, p) in enumerate(zip(experts, probs)):
            if (t, k) in kept:
                y_D = y_D + p * ref_expert(x_D, layer, e, act)
        if layer.shared is not None:
            y_D = y_D + ref_shared(x_D, layer, act)
        out.append(y_D)
    return torch.stack(out)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("seed", range(32))
def test_layer_matches_per_token_reference(seed):
    cfg = random_config(seed)
    dim, T = 12, 10
    layer, ref = build(cfg, dim, seed), build(cfg, dim, seed)
    x = torch.randn(2, T // 2, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    upstream = torch.randn(2, T // 2, dim, dtype=torch.float64)

    y = layer(x)
    (y * upstream).sum().backward()
    y_ref = reference_layer(x_ref.view(T, dim), ref, cfg).view_as(x)
    (y_ref * upstream).sum().backward()

    note = f"config: {dataclasses.asdict(cfg)}"
    # Routing probabilities and the combine sum are fp32 by design; everything else is fp64.
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol, msg=lambda m: f"{m}\n{note}")
    torch.testing.assert_close(x.grad, x_ref.grad, **tol, msg=lambda m: f"{m}\n{note}")
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **tol, msg=lambda m: f"{name}: {m}\n{note}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("memory_efficient", [True, False])
def test_experts_without_tokens_get_exact_zero_gradients(backend, memory_efficient):
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend=backend, pad_multiple=8,
                    memory_efficient_permute=memory_efficient, aux_loss_coeff=0.0)
    layer = build(cfg, 16, seed=0).float()
    with torch.no_grad():  # inputs are positive, so experts 1 and 3 (negative rows) never win
        layer.router.weight[1] = -1.0
        layer.router.weight[3] = -2.0
    x = (torch.rand(20, 16) + 0.1).requires_grad_()
    layer(x).square().sum().backward()
    for w in (layer.experts.w1_EDF, layer.experts.w3_EDF, layer.experts.w2_EFD):
        assert torch.isfinite(w.grad).all()
        assert w.grad[1].abs().sum() == 0 and w.grad[3].abs().sum() == 0
        assert w.grad[0].abs().sum() > 0 and w.grad[2].abs().sum() > 0
    assert torch.isfinite(x.grad).all()


def test_memory_efficient_permutation_saves_less_for_backward():
    def saved_bytes(memory_efficient: bool) -> int:
        cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, aux_loss_coeff=0.0,
                        memory_efficient_permute=memory_efficient, experts_backend=BACKENDS[-1])
        layer = build(cfg, 128, seed=0).float()
        x = torch.randn(256, 128, requires_grad=True)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        return total

    # Without it, the [T·K, D] expert output and the [T·K, F] activation output are kept.
    assert saved_bytes(True) < saved_bytes(False) - 256 * 2 * 128 * 4


def test_padding_tokens_are_not_routed():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, aux_loss_coeff=0.0)
    layer = build(cfg, 16, seed=1).float()
    x = torch.randn(2, 6, 16)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    y = layer(x, valid)
    assert y[1, 4:].abs().sum() == 0
    torch.testing.assert_close(y[0], layer(x[:1])[0])
    assert layer.stats.pop()["tokens_per_expert_E"].sum() == (10 + 6) * 2  # two forwards, K=2


@pytest.mark.skipif(len(BACKENDS) < 2, reason="torch._grouped_mm unavailable on this build")
@pytest.mark.parametrize("seed", range(8))
def test_grouped_mm_backend_matches_loop(seed):
    cfg = random_config(seed)
    layers = []
    for backend in ("loop", "grouped_mm"):
        layers.append(build(dataclasses.replace(cfg, experts_backend=backend), 16, seed).float())
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(seed))
    outs = []
    for layer in layers:
        x_ = x.clone().requires_grad_()
        y = layer(x_)
        y.square().sum().backward()
        outs.append([y, x_.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
