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


# ------------------------------------------------------------- transformers' MoE blocks, same weights


def _copy_experts(layer, hf_experts, gen: torch.Generator) -> None:
    """transformers 5 fuses experts as gate_up_proj [E, 2F, D] and down_proj [E, D, F]."""
    gate_up = hf_experts.gate_up_proj
    layer.experts.w1_EDF.copy_(gate_up[:, :F].transpose(1, 2))
    layer.experts.w3_EDF.copy_(gate_up[:, F:].transpose(1, 2))
    layer.experts.w2_EFD.copy_(hf_experts.down_proj.transpose(1, 2))


def _randomize(module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _deepseek_v3_pair(E, K, groups, group_top_k, scale, norm, backend, memory_efficient):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = DeepseekV3MoE(DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_group=max(groups, 1),
        topk_group=max(group_top_k, 1), n_shared_experts=1, routed_scaling_factor=scale, norm_topk_prob=norm))
    gen = torch.Generator().manual_seed(E * 100 + K)
    _randomize(hf, gen)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3 - 0.5)  # some < 0
    grouped = dict(num_groups=groups, group_top_k=group_top_k, group_score_top_k=2) if groups > 1 else {}
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, score_func="sigmoid", routed_scaling_factor=scale,
                    norm_topk_prob=norm, expert_bias=True, shared_experts=1, experts_backend=backend,
                    memory_efficient_permute=memory_efficient, aux_loss_coeff=0.0, **grouped)
    layer = build_moe_layer(D, cfg, "cpu", torch.float32)
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        layer.router.expert_bias_E.copy_(hf.gate.e_score_correction_bias)
        _copy_experts(layer, hf.experts, gen)
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(layer.shared, ours).weight.copy_(getattr(hf.shared_experts, theirs).weight)
    return hf, layer, hf.gate.weight, layer.router.weight


def _qwen3_pair(E, K, groups, group_top_k, scale, norm, backend, memory_efficient):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                               num_experts_per_tok=K, norm_topk_prob=norm))
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, norm_topk_prob=norm, experts_backend=backend,
                    memory_efficient_permute=memory_efficient, aux_loss_coeff=0.0)
    return _softmax_pair(hf, cfg)


def _mixtral_pair(E, K, groups, group_top_k, scale, norm, backend, memory_efficient):
    """Mixtral as its paper writes it: top-k of the logits, softmax over the K (moe.softmax_before_topk=false)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                             num_experts_per_tok=K))
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, softmax_before_topk=False, experts_backend=backend,
                    memory_efficient_permute=memory_efficient, aux_loss_coeff=0.0)
    return _softmax_pair(hf, cfg)


def _softmax_pair(hf, cfg: MoEConfig):
    gen = torch.Generator().manual_seed(cfg.num_experts * 100 + cfg.top_k)
    _randomize(hf, gen)
    layer = build_moe_layer(D, cfg, "cpu", torch.float32)
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        _copy_experts(layer, hf.experts, gen)
    return hf, layer, hf.gate.weight, layer.router.weight


PAIRS = {"deepseek_v3": _deepseek_v3_pair, "qwen3_moe": _qwen3_pair, "mixtral": _mixtral_pair}
# (E, K, groups, group_top_k, routed_scaling_factor, norm_topk_prob, experts backend, memory-efficient)
SHAPES = {
    "grouped": (16, 4, 4, 2, 2.5, True, "loop", True),
    "no-renorm-all-kept-experts": (16, 8, 4, 2, 2.5, False, "auto", False),  # K = the kept groups' 8
    "top_k=E": (8, 8, 4, 4, 1.0, True, "auto", True),
    "top_k=E-no-renorm": (8, 8, 0, 0, 2.5, False, "loop", False),
    "top_k=1": (8, 1, 0, 0, 1.0, False, "auto", True),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", PAIRS)
def test_layer_matches_transformers_moe_block_forward_and_backward(family, shape):
    """The same weights and tokens through transformers' block and ours (training mode, no aux
    loss): the same experts per token, and outputs and gradients (input, router, experts) equal to
    fp32 rounding. DeepSeek-V3: sigmoid, e_score_correction_bias, group-limited top-k (noaux_tc),
    routed_scaling_factor, shared expert."""
    E, K, groups, group_top_k, scale, norm, backend, memory_efficient = SHAPES[shape]
    if family != "deepseek_v3" and (groups or scale != 1.0):
        groups, group_top_k, scale = 0, 0, 1.0
    hf, layer, hf_router_w, router_w = PAIRS[family](E, K, groups, group_top_k, scale, norm, backend,
                                                       memory_efficient)
    hf.train(), layer.train()
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(7))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    _, _, idx_hf = hf.gate(x.view(-1, D))
    assert torch.equal(layer.router(x.view(-1, D)).idx_TK.sort(-1).values, idx_hf.sort(-1).values)

    y_hf, y = hf(x_hf), layer(x_ours)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=2e-6)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(8))
    grads_hf = torch.autograd.grad(y_hf, [x_hf, hf_router_w, hf.experts.gate_up_proj, hf.experts.down_proj],
                                   upstream)
    grads = torch.autograd.grad(y, [x_ours, router_w, layer.experts.w1_EDF, layer.experts.w3_EDF,
                                    layer.experts.w2_EFD], upstream)
    gate_up_hf = grads_hf[2].transpose(1, 2)
    expected = [grads_hf[0], grads_hf[1], gate_up_hf[..., :F], gate_up_hf[..., F:], grads_hf[3].transpose(1, 2)]
    for name, got, want in zip(["x", "router", "w1", "w3", "w2"], grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-6, msg=lambda m: f"{name}: {m}")


def test_deepseek_v3_ties_choose_the_experts_transformers_chooses():
    """A zero router (transformers' DeepSeek-V3 initialisation) ties every score at 0.5: group and
    expert top-k must break the ties as transformers' noaux_tc does."""
    hf, layer, hf_router_w, router_w = _deepseek_v3_pair(16, 4, 4, 2, 2.5, True, "loop", True)
    with torch.no_grad():
        hf_router_w.zero_(), router_w.zero_()
        hf.gate.e_score_correction_bias.zero_(), layer.router.expert_bias_E.zero_()
    x_TD = torch.randn(6, D, generator=torch.Generator().manual_seed(1))
    _, probs_hf, idx_hf = hf.gate(x_TD)
    routing = layer.router(x_TD)
    assert torch.equal(routing.idx_TK.sort(-1).values, idx_hf.sort(-1).values)
    torch.testing.assert_close(routing.probs_TK, torch.full((6, 4), 2.5 / 4))
    torch.testing.assert_close(layer(x_TD[None])[0], hf(x_TD[None])[0], rtol=1e-5, atol=2e-6)


# --------------------------------------------------------------------- capacity, a per-copy loop


def naive_keep(idx_TK, probs_TK, valid_T, num_experts, factor, policy):
    """Each expert keeps its first C = min(R, ceil(factor·R·K/E)) copies, R the real tokens (all T
    without padding): real tokens' before padding's, then highest probability first (ties: token
    order, then k) or earliest token first."""
    T, K = idx_TK.shape
    R = T if valid_T is None else int(valid_T.sum())
    C = min(R, math.ceil(factor * R * K / num_experts - 1e-9))
    copies = [(t, k) for t in range(T) for k in range(K)]
    if policy == "probs":
        copies.sort(key=lambda c: -probs_TK[c].item())
    if valid_T is not None:
        copies.sort(key=lambda c: not valid_T[c[0]].item())
    keep, used = torch.zeros(T, K, dtype=torch.bool), [0] * num_experts
    for t, k in copies:
        e = idx_TK[t, k].item()
        keep[t, k], used[e] = used[e] < C, used[e] + 1
    return keep


@pytest.mark.parametrize("seed", range(40))
def test_capacity_keeps_the_copies_a_per_copy_loop_keeps(seed):
    """Random E, K (up to E), T, factor and policy; a third of the cases send every token to the
    same experts (one expert takes every token), a fifth round the probabilities to make ties, half
    have padding."""
    gen = torch.Generator().manual_seed(seed)
    E = (2, 4, 8)[seed % 3]
    K = 1 + int(torch.randint(E, (), generator=gen))
    T = 1 + int(torch.randint(20, (), generator=gen))
    factor = (0.25, 0.5, 1.0, 1.25, 2.0)[seed % 5]
    policy = ("probs", "position")[seed % 2]
    logits_TE = torch.randn(T, E, generator=gen)
    if seed % 3 == 0:
        logits_TE = torch.arange(E) * 0.01 + torch.zeros(T, E)
    probs_TK, idx_TK = logits_TE.softmax(-1).topk(K)
    if seed % 5 == 0:
        probs_TK = probs_TK.round(decimals=1)
    valid_T = torch.rand(T, generator=gen) > 0.3 if seed % 4 >= 2 else None
    valid_N = None if valid_T is None else valid_T.repeat_interleave(K)
    keep_TK = build_capacity(E, factor, policy)(idx_TK, probs_TK, valid_N).view(T, K)
    expected_TK = naive_keep(idx_TK, probs_TK, valid_T, E, factor, policy)
    if valid_T is not None:  # the layer drops padding's copies whatever the capacity kept
        keep_TK, expected_TK = keep_TK & valid_T[:, None], expected_TK & valid_T[:, None]
    assert torch.equal(keep_TK, expected_TK), (E, K, T, factor, policy)


# ------------------------------------------------------ balancing losses, from the papers' formulas


def naive_losses(logits_TE, idx_TK, batch_size, score_func, valid_T):
    """Switch (micro-batch), DeepSeek-V3 (per sequence, scores s/Σs for sigmoid) and ST-MoE z-loss,
    one token at a time: E · Σ_e f_e · P_e with f_e = copies to e / (K · tokens), P_e = mean score."""
    T, E = logits_TE.shape
    K, S = idx_TK.shape[1], T // batch_size
    scores_TE = logits_TE.softmax(-1) if score_func == "softmax" else logits_TE.sigmoid()
    scores_TE = scores_TE / scores_TE.sum(-1, keepdim=True)

    def balance(tokens):
        f = [sum(int(idx_TK[t, k]) == e for t in tokens for k in range(K)) / (K * len(tokens)) for e in range(E)]
        P = sum(scores_TE[t] for t in tokens) / len(tokens)
        return E * sum(f[e] * P[e] for e in range(E))

    real = [t for t in range(T) if valid_T[t]]
    sequences = [[t for t in range(b * S, (b + 1) * S) if valid_T[t]] for b in range(batch_size)]
    per_sequence = [balance(tokens) for tokens in sequences if tokens]
    z = sum(torch.logsumexp(logits_TE[t], -1) ** 2 for t in real) / len(real)
    return balance(real), sum(per_sequence) / len(per_sequence), z


@pytest.mark.parametrize("router", [dict(score_func="softmax"), dict(score_func="softmax", softmax_before_topk=False),
                                    dict(score_func="sigmoid", num_groups=4, group_top_k=2, expert_bias=True)])
def test_router_gradient_of_the_injected_losses_is_the_papers_losses(router):
    """The router's gradient with aux, sequence aux and z-loss injected equals the gradient of the
    layer's output plus the coefficients times the per-token formulas (padding left out, one
    sequence all padding)."""
    coeffs = dict(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.7, z_loss_coeff=0.11)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, router_dtype="fp64", **router, **coeffs)
    layer = build_moe_layer(D, cfg, "cpu", torch.float64).double()
    _randomize(layer, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    x_BSD = torch.randn(3, 5, D, dtype=torch.float64, generator=gen)
    valid_BS = torch.rand(3, 5, generator=gen) > 0.3
    valid_BS[1] = False
    upstream = torch.randn(3, 5, D, dtype=torch.float64, generator=gen)
    layer.train()
    (layer(x_BSD, valid_BS) * upstream).sum().backward()
    grad = layer.router.weight.grad.clone()

    layer.zero_grad()
    layer.balancer.terms = []  # the layer's output alone; the losses below from their formulas
    y_BSD = layer(x_BSD, valid_BS)
    logits_TE = x_BSD.view(-1, D) @ layer.router.weight.T
    idx_TK = layer.router(x_BSD.view(-1, D)).idx_TK
    aux, seq_aux, z = naive_losses(logits_TE, idx_TK, 3, cfg.score_func, valid_BS.view(-1))
    ((y_BSD * upstream).sum() + coeffs["aux_loss_coeff"] * aux + coeffs["seq_aux_loss_coeff"] * seq_aux
     + coeffs["z_loss_coeff"] * z).backward()
    torch.testing.assert_close(grad, layer.router.weight.grad, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ expert bias (aux-loss-free)


def test_expert_bias_steps_by_the_sign_of_the_steps_real_copies_per_expert():
    """DeepSeek-V3 §2.1.2: after each step, b_e += γ·sign(mean load − load_e), the load being the
    step's routed copies (every micro-batch's, padding excluded, evaluation forwards not counted),
    and the bias moves the selection only: probabilities stay the unbiased scores'."""
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=F, score_func="sigmoid", expert_bias=True,
                    expert_bias_update_rate=0.25, aux_loss_coeff=0.0)
    layer = build_moe_layer(D, cfg, "cpu", torch.float32)
    _randomize(layer, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 6, D, generator=gen), torch.rand(2, 6, generator=gen) > 0.4) for _ in range(2)]
    counts_E = torch.zeros(8)
    layer.train()
    for x_BSD, valid_BS in batches:
        layer(x_BSD, valid_BS)
        idx_TK = layer.router(x_BSD.view(-1, D)).idx_TK
        for t, experts in enumerate(idx_TK.tolist()):
            for e in experts:
                counts_E[e] += float(valid_BS.view(-1)[t])
    layer.eval()
    layer(torch.randn(3, 4, D, generator=gen))  # an evaluation forward: not the step's load
    layer.on_optimizer_step()
    expected_E = 0.25 * torch.sign(counts_E.mean() - counts_E)
    assert expected_E.abs().sum() > 0
    torch.testing.assert_close(layer.router.expert_bias_E, expected_E)

    x_TD = torch.randn(10, D, generator=gen)
    routing = layer.router(x_TD)
    scores_TE = (x_TD @ layer.router.weight.T).sigmoid()
    biased_idx_TK = (scores_TE + expected_E).topk(2).indices
    assert torch.equal(routing.idx_TK.sort(-1).values, biased_idx_TK.sort(-1).values)
    chosen_TK = scores_TE.gather(-1, routing.idx_TK)
    torch.testing.assert_close(routing.probs_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True))
