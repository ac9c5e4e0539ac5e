"""A per-token loop reference of the MoE layer, and random layer configurations to test it on.

The reference routes, drops and computes one token at a time in fp64, straight from the definitions:
nothing is shared with the implementation but the weights. Used by the CPU tests (tests/unit) and
the GPU tests (tests/gpu).
"""

import math
import random

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
    return without_inert_options(cfg)


def without_inert_options(cfg: MoEConfig) -> MoEConfig:
    """`cfg` with the options its layer would not read at their defaults, which build_moe_layer
    refuses otherwise. Set after every draw, so each seed keeps the random sequence and the layer
    it always had."""
    if cfg.shared_experts == 0:
        cfg.shared_expert_gate = MoEConfig.shared_expert_gate
    if cfg.score_func == "softmax" and not cfg.softmax_before_topk:  # the K weights sum to 1 already
        cfg.norm_topk_prob = MoEConfig.norm_topk_prob
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
