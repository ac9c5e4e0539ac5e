"""Tests found by mutation testing of moe/ (router renormalisation, z-loss masking, the shared-expert
gate, recording under compile), train/chunked_loss.py's clamps, fp8/saved.py and bench/limit.py:
each kills a change to the source that every other unit test let through, against an independent
reference (transformers' modules where they hold the definition, else naive code)."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from moefold.config import MoEConfig
from moefold.moe.balance import z_loss
from moefold.moe.layer import build_moe_layer
from moefold.moe.router import build_router

# ---------------------------------------------------------------- router: renormalisation guard


def _dense(probs_TK, idx_TK, E):
    """[T, E] combine weights, 0 off the chosen experts: the same for any order of the K."""
    return torch.zeros(idx_TK.shape[0], E, dtype=probs_TK.dtype).scatter(1, idx_TK, probs_TK)


def test_sigmoid_renormalisation_matches_deepseek_v3_at_vanishing_scores():
    """DeepSeek-V3 divides the chosen sigmoid scores by their sum + 1e-20. Scores near 1e-17 tell
    that eps from 0 or another size (the router grid's scores are O(1), where 1e-20 vanishes), and
    scores that underflow to 0 give 0 weights, not 0/0 = NaN."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, K, T = 8, 2, 16
    D = T  # x = the identity, so each token's logits are its row of the weight's transpose
    hf_cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=1,
                                           topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    hf = DeepseekV3TopkRouter(hf_cfg)
    ours = build_router(D, MoEConfig(num_experts=E, top_k=K, score_func="sigmoid", norm_topk_prob=True))
    # logits -40 .. -37 (sigmoid 4e-18 .. 9e-17: the eps 1e-20 is 1e-4 .. 1e-3 of their sum), and
    # a last token at -120, whose sigmoid underflows to 0 in fp32
    logits_TE = -40.0 + 3.0 * torch.rand(T, E, generator=torch.Generator().manual_seed(0))
    logits_TE[-1] = -120.0
    with torch.no_grad():
        hf.weight.copy_(logits_TE.T)
        ours.weight.copy_(logits_TE.T)
    x_TD = torch.eye(T)
    _, hf_probs_TK, hf_idx_TK = hf(x_TD)
    routing = ours(x_TD)
    assert torch.isfinite(routing.probs_TK).all() and torch.equal(routing.probs_TK[-1], torch.zeros(K))
    torch.testing.assert_close(_dense(routing.probs_TK.double(), routing.idx_TK, E),
                               _dense(hf_probs_TK.double(), hf_idx_TK, E), rtol=1e-6, atol=0.0)


def test_softmax_renormalisation_guard_is_deepseeks_1e_20_under_an_expert_bias():
    """With an expert bias the chosen softmax scores need not hold the best one: chosen scores near
    1e-17 are divided by their sum + 1e-20 (DeepSeek-V3's guard), and all-underflowed ones give 0."""
    E, K = 4, 2
    router = build_router(1, MoEConfig(num_experts=E, top_k=K, expert_bias=True))
    logits_E = torch.tensor([0.0, -38.0, -39.5, -200.0])  # softmax ≈ 1, 3e-17, 7e-18, 0
    with torch.no_grad():
        router.weight.copy_(logits_E[:, None])
        router.expert_bias_E.copy_(torch.tensor([-10.0, 5.0, 5.0, 0.0]))  # choose experts 1 and 2
    routing = router(torch.ones(1, 1))
    assert sorted(routing.idx_TK[0].tolist()) == [1, 2]
    chosen = logits_E.double().softmax(-1)[routing.idx_TK[0]]
    torch.testing.assert_close(routing.probs_TK[0].double(), chosen / (chosen.sum() + 1e-20), rtol=1e-6, atol=0.0)
    with torch.no_grad():  # experts 1 and 3 chosen, both underflowed
        router.weight.copy_(torch.tensor([[0.0], [-200.0], [0.0], [-200.0]]))
        router.expert_bias_E.copy_(torch.tensor([-10.0, 5.0, -10.0, 5.0]))
    probs_TK = router(torch.ones(1, 1)).probs_TK
    assert torch.equal(probs_TK, torch.zeros(1, K))


# ---------------------------------------------------------------- z-loss under a padding mask


def test_z_loss_ignores_padded_tokens_and_their_gradient_stays_zero():
    """ST-MoE's z-loss over the valid tokens only. Padded tokens' logits can be anything (a
    padding row's hidden state is never trained): huge or NaN, they must neither reach the loss
    nor put NaN into the router's gradient through the mask (a where after logsumexp alone passes
    the forward and leaves grad 0 · inf = NaN)."""
    gen = torch.Generator().manual_seed(0)
    logits_TE = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    valid_T = torch.tensor([True, False, True, True, False, True])
    padded_TE = logits_TE.clone()
    padded_TE[1], padded_TE[4] = 1e200, float("nan")
    padded_TE.requires_grad_()
    loss = z_loss(padded_TE, valid_T)
    loss.backward()
    reference = torch.logsumexp(logits_TE[valid_T], dim=-1).square().mean()
    torch.testing.assert_close(loss.double(), reference)
    grad_TE = padded_TE.grad
    assert torch.isfinite(grad_TE).all() and torch.equal(grad_TE[~valid_T], torch.zeros(2, 4, dtype=grad_TE.dtype))
    lse_T = torch.logsumexp(logits_TE[valid_T], dim=-1, keepdim=True)
    torch.testing.assert_close(grad_TE[valid_T], 2 * lse_T * logits_TE[valid_T].softmax(-1) / 4)


# ---------------------------------------------------------------- Qwen2-MoE's gated shared expert


def test_gated_shared_expert_matches_qwen2_moe():
    """moe.shared_expert_gate: Qwen2-MoE's sigmoid(shared_expert_gate(x)) · shared_expert(x), against
    transformers' own sparse MoE block with its routed experts zeroed (their output is then 0)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    D, F_, E = 16, 24, 4
    hf_cfg = transformers.Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=8, shared_expert_intermediate_size=F_,
                                         num_experts=E, num_experts_per_tok=2, hidden_act="silu")
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).double()
    cfg = MoEConfig(num_experts=E, top_k=2, expert_hidden=8, shared_experts=1, shared_expert_hidden=F_,
                    shared_expert_gate=True)
    shared = build_moe_layer(D, cfg, "cpu", torch.float64).shared.double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for p in hf.experts.parameters():
            p.zero_()
        shared.w1.weight.copy_(hf.shared_expert.gate_proj.weight)
        shared.w3.weight.copy_(hf.shared_expert.up_proj.weight)
        shared.w2.weight.copy_(hf.shared_expert.down_proj.weight)
        shared.gate.weight.copy_(hf.shared_expert_gate.weight)
    x_BSD = torch.randn(2, 5, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(shared(x_BSD.view(-1, D)).view_as(x_BSD), hf(x_BSD))


# ---------------------------------------------------------------- recording once under torch.compile


def test_a_compiled_training_forward_records_its_routing_once():
    """in_backward() takes code being traced for a forward: a compiled training forward records
    the load statistics and the step's counts as an eager one does (taking itself for a recompute
    there, it recorded nothing: the expert-bias update saw no load)."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, expert_bias=True, z_loss_coeff=1e-3)
    eager = build_moe_layer(8, cfg, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    compiled_layer = build_moe_layer(8, cfg, "cpu", torch.float32)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, backend="eager", fullgraph=False)
    x_BSD = torch.randn(2, 8, 8, generator=gen)
    for layer in (eager, compiled):
        layer(x_BSD).square().mean().backward()
    assert eager.step_tokens_per_expert_E.sum().item() == 2 * 8 * 2
    assert torch.equal(compiled_layer.step_tokens_per_expert_E, eager.step_tokens_per_expert_E)


# ---------------------------------------------------------------- chunked loss: its clamps


def _head_case(labels_T):
    gen = torch.Generator().manual_seed(0)
    T, D, V = labels_T.numel(), 8, 11
    h_1TD = torch.randn(1, T, D, generator=gen)
    w_VD = torch.randn(V, D, generator=gen)
    return h_1TD, w_VD, labels_T[None]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_chunked_loss_with_one_labelled_token_is_its_cross_entropy(grad):
    """The mean divides by the labelled tokens, clamped to 1 only for none: with one labelled
    token (label 0, which the ignored labels' clamp to a valid index must not disturb) the loss and
    its gradients are F.cross_entropy's."""
    from moefold.train.chunked_loss import chunked_linear_cross_entropy

    h_1TD, w_VD, labels_1T = _head_case(torch.tensor([-100, -100, 0, -100, -100]))
    h_ref, w_ref = h_1TD.clone().requires_grad_(), w_VD.clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.T)[0], labels_1T[0], ignore_index=-100)
    ref.backward()
    h_1TD.requires_grad_(), w_VD.requires_grad_()
    with torch.set_grad_enabled(grad):
        loss = chunked_linear_cross_entropy(h_1TD, w_VD, labels_1T, chunk=2)
    torch.testing.assert_close(loss, ref.detach())
    if grad:
        loss.backward()
        torch.testing.assert_close(h_1TD.grad, h_ref.grad)
        torch.testing.assert_close(w_VD.grad, w_ref.grad)


def test_fused_chunk_step_reads_label_zero():
    """The compiled loss's step (run eagerly here) clamps ignored labels to a valid index without
    moving a real label 0: loss and logits' gradient are F.cross_entropy's."""
    from moefold.train.chunked_loss import fused_chunk_loss_and_grad

    h_1TD, w_VD, labels_1T = _head_case(torch.tensor([0, -100, 3, 0, 10]))
    logits_TV = (h_1TD[0] @ w_VD.T).requires_grad_()
    ref = F.cross_entropy(logits_TV, labels_1T[0], ignore_index=-100, reduction="sum")
    (ref / 4).backward()
    loss, grad_TV = fused_chunk_loss_and_grad(h_1TD[0], w_VD, labels_1T[0], torch.tensor(4))
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad_TV, logits_TV.grad)


# ---------------------------------------------------------------- fp8/saved.py: nothing kept without grad


def test_fp8_saved_inputs_are_not_quantized_for_a_forward_without_grad(monkeypatch):
    """precision.fp8_saved_activations quantizes a GEMM's input to keep it for the backward; an
    evaluation or generation forward (no grad) keeps nothing, so it must not pay for that copy
    (it quantized every linear's and the experts' input again, for nothing) and gives the same
    output. A training forward still keeps them in FP8."""
    from moefold.config import load_config
    from moefold.fp8.apply import apply_fp8
    from moefold.fp8.saved import SaveFp8Input
    from moefold.models.transformer import build_model

    cfg = load_config("tiny-qwen3", {"model.dim": 128, "model.n_heads": 4, "model.head_dim": 32,
                                     "model.n_kv_heads": 4, "model.ffn_hidden": 128, "moe.expert_hidden": 128,
                                     "moe.num_experts": 4, "moe.top_k": 2, "model.n_layers": 2,
                                     "precision.fp8": "rowwise", "precision.fp8_saved_activations": True})
    model = build_model(cfg, 256)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # build_model leaves some parameters as torch.empty made them
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    apply_fp8(model, cfg.precision, "cpu", shared_inputs=False)
    assert any(isinstance(getattr(m, "saver", None), SaveFp8Input) for m in model.modules())
    packs = []
    real_pack = SaveFp8Input.pack
    monkeypatch.setattr(SaveFp8Input, "pack", lambda self, x: packs.append(1) or real_pack(self, x))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        no_grad_logits = model(ids)
    assert packs == []
    with torch.inference_mode():
        model(ids)
    assert packs == []
    logits = model(ids)  # eval mode, grad on: what a backward would need is kept
    assert packs
    assert torch.isfinite(no_grad_logits).all()
    torch.testing.assert_close(no_grad_logits, logits.detach(), rtol=0, atol=0)


# ---------------------------------------------------------------- bench/limit.py: the optimizer row


def test_the_limit_optimizer_row_prints_the_mtp_modules_apart():
    """The optimizer steps every parameter, MTP modules included, but its row prints them as every
    other count does (`params_line`, `config params`: the model without MTP, the MTP modules
    apart); it printed their sum as the model's size. Counted here by hand from the names."""
    from moefold.bench.limit import _optimizer_row
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    cfg = load_config("tiny-deepseek", {"model.n_layers": "2"})
    assert cfg.model.mtp_layers == 1
    named = build_model(cfg, 256, "cpu", torch.float32).named_parameters()
    sizes = {"main": 0, "mtp": 0}
    for name, p in named:  # shared embedding and head: listed once, under the trunk's names
        sizes["mtp" if name.startswith("mtp.") else "main"] += p.numel()
    row = _optimizer_row(cfg, 256, torch.device("cpu"), torch.float32, repeats=1)
    # in the units every count prints (a tiny model read 0.000B)
    assert f"{sizes['main'] / 1e6:.2f}M parameters, MTP modules {sizes['mtp'] / 1e6:.2f}M more" in row.name


# ---------------------------------------------------------------- Qwen3's q_norm and k_norm


def test_q_norm_and_k_norm_are_qwen3_rmsnorms_with_the_models_eps():
    """Qwen3 normalises each query and key head by Qwen3RMSNorm(head_dim, eps=rms_norm_eps): both
    take model.norm_eps. At an eps comparable to the heads' mean square (0.5 here) a k_norm with
    another eps (the 1e-6 default) gives other keys."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from moefold.models.attention import Attention

    head_dim, eps = 8, 0.5
    attn = Attention(16, 2, 1, head_dim, qk_norm=True, norm_eps=eps)
    hf = Qwen3RMSNorm(head_dim, eps=eps)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm, hf):
            norm.weight.copy_(torch.linspace(0.5, 1.5, head_dim))
    x = torch.randn(3, 4, head_dim, generator=gen) * 0.7
    for norm in (attn.q_norm, attn.k_norm):
        torch.testing.assert_close(norm(x), hf(x))


def test_z_loss_of_one_valid_token_is_its_squared_logsumexp():
    """The mean's divisor is clamped to 1 only for no valid token: with one it is that token's."""
    logits_TE = torch.tensor([[0.5, -1.0, 2.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    loss = z_loss(logits_TE, torch.tensor([True, False]))
    torch.testing.assert_close(loss.double(), torch.logsumexp(logits_TE[0], -1).square())
    assert z_loss(logits_TE, torch.tensor([False, False])).item() == 0.0


def test_sigmoid_balance_scores_are_normalised_per_token_with_the_1e_20_guard():
    """DeepSeek-V3's sequence-wise loss reads each token's sigmoid scores normalised to sum 1
    (Megatron: scores / (sum + 1e-20)): at scores near 1e-17 they still sum to 1, and a padded
    token whose scores underflow to 0 gives zeros, whose gradient through the mask is 0, not NaN."""
    from moefold.moe.balance import sequence_aux_loss

    E, T = 4, 6
    router = build_router(T, MoEConfig(num_experts=E, top_k=2, score_func="sigmoid"))
    logits_TE = -40.0 + 3.0 * torch.rand(T, E, generator=torch.Generator().manual_seed(0))
    logits_TE[2] = -120.0
    with torch.no_grad():
        router.weight.copy_(logits_TE.T)
    routing = router(torch.eye(T))
    scores_TE = logits_TE.sigmoid().double()  # fp32 scores, as the router takes them: row 2 underflows
    expected_TE = scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(routing.scores_TE.double(), expected_TE, rtol=1e-6, atol=0.0)
    valid_T = torch.arange(T) != 2
    sequence_aux_loss(routing.scores_TE, routing.idx_TK, 1, valid_T).backward()
    assert torch.isfinite(router.weight.grad).all()
