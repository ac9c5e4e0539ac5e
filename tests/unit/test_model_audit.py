"""Audit of the model code against independent references: transformers' attention modules on
identical weights (outputs and every gradient, fp32 and bf16), a naive attention written here (band
masks at and around the sequence length, one-token sequences), YaRN past the pre-training length,
MTP's targets and loss written out from the DeepSeek-V3 paper, and option validation."""

import pytest
import torch
import torch.nn.functional as F

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.models.attention import Attention
from moefold.models.mla import MLAttention
from moefold.models.rope import RopeScaling, rope_cos_sin, yarn_softmax_scale_factor
from moefold.models.transformer import build_model

transformers = pytest.importorskip("transformers")

DIM, HEADS, KV_HEADS, HEAD_DIM, THETA = 48, 4, 2, 12, 10000.0
GQA_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm",
             "k_norm": "k_norm"}
MLA_NAMES = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _close(actual, expected, rtol):
    """Within rtol of the tensor's largest entry (bf16 rounding differs entry by entry); within 1e-4
    of a gradient that is 0 in exact arithmetic (one visible key: the keys' weights; SDPA's
    backward leaves ~1e-6 there, eager attention 0)."""
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol * scale if scale else 1e-4)


def _randomize(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():  # norms too, so a swapped or unused weight shows
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _copy_into(ours, hf_module, names):
    state = {f"{names[k.split('.')[0]]}.{k.split('.', 1)[1]}": v for k, v in hf_module.state_dict().items()}
    ours.load_state_dict(state, strict=True)


def _band_additive_mask(seq_len, window, dtype):
    """0 where key j is visible from query i (j ≤ i, and i − j < window when window > 0), else the
    dtype's minimum: eager attention's form, built independently of moefold's masks."""
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(seq_len, seq_len, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def _run_both(hf_attn, hf_rotary, ours, cos_sin, seq_len, dtype, window=0, batch=2):
    """(outputs, input grads, {our param name: (ours.grad, hf.grad)}) for one random input and
    output gradient."""
    torch.manual_seed(1)
    x = torch.randn(batch, seq_len, DIM, dtype=dtype)
    grad_out = torch.randn(batch, seq_len, DIM, dtype=dtype)
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    positions = torch.arange(seq_len)[None].expand(batch, seq_len)
    out_hf, _ = hf_attn(x_hf, hf_rotary(x_hf, positions), _band_additive_mask(seq_len, window, dtype))
    out_ours = ours(x_ours, *cos_sin)
    out_hf.backward(grad_out)
    out_ours.backward(grad_out)
    ours_params = dict(ours.named_parameters())
    grads = {}
    for name, p in hf_attn.named_parameters():
        module, leaf = name.split(".", 1)
        grads[name] = (ours_params[f"{hf_names(hf_attn)[module]}.{leaf}"].grad, p.grad)
    return (out_ours, out_hf), (x_ours.grad, x_hf.grad), grads


def hf_names(hf_attn):
    return MLA_NAMES if hasattr(hf_attn, "kv_a_proj_with_mqa") else GQA_NAMES


def _assert_all_close(outs, x_grads, grads, rtol):
    _close(*outs, rtol)
    _close(*x_grads, rtol)
    for name, (ours, theirs) in grads.items():
        assert ours is not None, f"{name}: no gradient"
        _close(ours, theirs, rtol)


# ---- GQA against transformers' Qwen3-MoE (QK-norm) and Mistral (sliding window) ----

def _qwen3_pair(dtype, scaling=None, qk_norm=True):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    rope = {"rope_type": "default", "rope_theta": THETA}
    if scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": THETA, "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_len,
                "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
    config = Qwen3MoeConfig(hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                            head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_parameters=rope,
                            max_position_embeddings=8192, attn_implementation="eager")
    hf_attn = hf.Qwen3MoeAttention(config, layer_idx=0)
    _randomize(hf_attn)
    ours = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, qk_norm=qk_norm, norm_eps=1e-6)
    _copy_into(ours, hf_attn, GQA_NAMES)
    return hf_attn.to(dtype), hf.Qwen3MoeRotaryEmbedding(config), ours.to(dtype)


def _mistral_pair(dtype, window):
    from transformers import MistralConfig
    from transformers.models.mistral import modeling_mistral as hf

    config = MistralConfig(hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                           sliding_window=window or None, attn_implementation="eager")
    hf_attn = hf.MistralAttention(config, layer_idx=0)
    _randomize(hf_attn)
    ours = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, qk_norm=False, norm_eps=1e-6, sliding_window=window)
    _copy_into(ours, hf_attn, GQA_NAMES)
    return hf_attn.to(dtype), hf.MistralRotaryEmbedding(config), ours.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [1, 2, 9])
def test_qk_norm_gqa_outputs_and_gradients_match_qwen3_moe(dtype, seq_len):
    hf_attn, hf_rotary, ours = _qwen3_pair(dtype)
    cos_sin = rope_cos_sin(seq_len, HEAD_DIM, THETA)
    _assert_all_close(*_run_both(hf_attn, hf_rotary, ours, cos_sin, seq_len, dtype), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 8, 9])
def test_sliding_window_outputs_and_gradients_match_mistral(dtype, window):
    """Windows of one token, just under, at and just over the 8-token sequence."""
    hf_attn, hf_rotary, ours = _mistral_pair(dtype, window)
    cos_sin = rope_cos_sin(8, HEAD_DIM, THETA)
    _assert_all_close(*_run_both(hf_attn, hf_rotary, ours, cos_sin, 8, dtype, window=window), TOL[dtype])


def test_yarn_gqa_past_the_pretraining_length_matches_qwen3_moe():
    """YaRN tables at positions 0..95 with a pre-training length of 16 (6x past it): tables bit for
    bit, and the attention's outputs and gradients."""
    scaling = RopeScaling(factor=4.0, original_max_len=16, beta_fast=8.0, beta_slow=1.0)
    hf_attn, hf_rotary, ours = _qwen3_pair(torch.float32, scaling)
    cos, sin = rope_cos_sin(96, HEAD_DIM, THETA, scaling=scaling)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, 96, DIM), torch.arange(96)[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)
    _assert_all_close(*_run_both(hf_attn, hf_rotary, ours, (cos, sin), 96, torch.float32, batch=1), TOL[torch.float32])


# ---- MLA against transformers' DeepSeek-V3 ----

MLA_KV_LORA, MLA_NOPE, MLA_ROPE, MLA_V = 24, 8, 8, 10


def _deepseek_pair(dtype, q_lora_rank, scaling=None):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {"rope_type": "default", "rope_theta": THETA}
    if scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": THETA, "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_len, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    config = DeepseekV3Config(hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              q_lora_rank=q_lora_rank or None, kv_lora_rank=MLA_KV_LORA,
                              qk_nope_head_dim=MLA_NOPE, qk_rope_head_dim=MLA_ROPE, v_head_dim=MLA_V,
                              rope_interleave=True, rope_parameters=rope, max_position_embeddings=8192,
                              attn_implementation="eager")
    hf_attn = hf.DeepseekV3Attention(config, layer_idx=0)
    _randomize(hf_attn)
    ours = MLAttention(DIM, HEADS, q_lora_rank, MLA_KV_LORA, MLA_NOPE, MLA_ROPE, MLA_V, 1e-6,
                       softmax_scale_factor=yarn_softmax_scale_factor(scaling), interleaved_rope=True)
    _copy_into(ours, hf_attn, MLA_NAMES)
    return hf_attn.to(dtype), hf.DeepseekV3RotaryEmbedding(config), ours.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lora_rank", [0, 16])
@pytest.mark.parametrize("seq_len", [1, 7])
def test_mla_outputs_and_gradients_match_deepseek_v3(dtype, q_lora_rank, seq_len):
    hf_attn, hf_rotary, ours = _deepseek_pair(dtype, q_lora_rank)
    cos_sin = rope_cos_sin(seq_len, MLA_ROPE, THETA)
    _assert_all_close(*_run_both(hf_attn, hf_rotary, ours, cos_sin, seq_len, dtype), TOL[dtype])


def test_yarn_mla_past_the_pretraining_length_matches_deepseek_v3():
    """DeepSeek's YaRN (mscale = mscale_all_dim: tables unscaled, softmax scale times mscale²) at
    positions 0..79 with a pre-training length of 16."""
    scaling = RopeScaling(factor=8.0, original_max_len=16, beta_fast=8.0, beta_slow=1.0, mscale=1.0,
                          mscale_all_dim=1.0)
    hf_attn, hf_rotary, ours = _deepseek_pair(torch.float32, 0, scaling)
    cos_sin = rope_cos_sin(80, MLA_ROPE, THETA, scaling=scaling)
    _assert_all_close(*_run_both(hf_attn, hf_rotary, ours, cos_sin, 80, torch.float32, batch=1), TOL[torch.float32])


# ---- options that cannot work, or that the model would silently ignore ----

@pytest.mark.parametrize("overrides, message", [
    ({"model.yarn_beta_fast": "8"}, "model.yarn_beta_fast=8.0 needs model.rope_scaling='yarn'"),
    ({"model.yarn_beta_slow": "2"}, "model.yarn_beta_slow=2.0 needs model.rope_scaling='yarn'"),
    ({"model.yarn_mscale": "0.707"}, "model.yarn_mscale=0.707 needs model.rope_scaling='yarn'"),
    ({"model.yarn_mscale_all_dim": "1"}, "model.yarn_mscale_all_dim=1.0 needs model.rope_scaling='yarn'"),
    ({"model.rope_original_max_len": "2048"}, "model.rope_original_max_len=2048 needs model.rope_scaling='yarn'"),
])
def test_a_yarn_option_without_yarn_is_refused(overrides, message):
    """Without YaRN the tables are plain RoPE's: each of these trained bit for bit as without it,
    while model.rope_factor (their sibling) was already refused."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config("tiny-qwen3", overrides)
    load_config("tiny-qwen3", {**overrides, "model.rope_scaling": "yarn", "model.rope_factor": "4"})


def test_yarn_with_beta_fast_below_beta_slow_is_refused():
    """The ramp runs backwards: the fastest dims were interpolated by 1/factor and the slowest kept,
    YaRN's opposite (transformers only warns)."""
    yarn = {"model.rope_scaling": "yarn", "model.rope_factor": "4"}
    cos_ok, _ = rope_cos_sin(4, 16, THETA, scaling=RopeScaling(4.0, 64, beta_fast=32.0, beta_slow=1.0))
    cos_swapped, _ = rope_cos_sin(4, 16, THETA, scaling=RopeScaling(4.0, 64, beta_fast=1.0, beta_slow=32.0))
    assert not torch.allclose(cos_ok, cos_swapped)
    with pytest.raises(ConfigError, match=r"^model.yarn_beta_fast=1.0 must be >= model.yarn_beta_slow=32.0"):
        load_config("tiny-qwen3", {**yarn, "model.yarn_beta_fast": "1", "model.yarn_beta_slow": "32"})
    load_config("tiny-qwen3", {**yarn, "model.yarn_beta_fast": "4", "model.yarn_beta_slow": "4"})


def test_qk_norm_under_mla_is_refused():
    """MLA normalises its latents (q_norm, kv_norm) and has no per-head QK-norm: qk_norm=true built
    the same model as false."""
    with pytest.raises(ConfigError, match=r"^model.qk_norm=true needs model.attention='gqa'"):
        load_config("tiny-deepseek", {"model.qk_norm": "true"})
    cfg = load_config("tiny-deepseek")
    assert not cfg.model.qk_norm and build_model(cfg, 50).layers[0].attn.__class__ is MLAttention


# ---- MTP from the DeepSeek-V3 paper (arXiv 2412.19437, section 2.2) ----

def test_mtp_objective_is_the_papers_written_out_depth_by_depth():
    """Tokens t_1..t_T+1 (inputs t_1..t_T, next-token labels t_2..t_T+1). Depth k, for i = 1..T−k:
    h'_i^k = M_k [RMSNorm(h_i^(k−1)); RMSNorm(Emb(t_(i+k)))] (the checkpoint's eh_proj takes the
    embedding half first), h^k_(1:T−k) = TRM_k(h'^k_(1:T−k)), P^k_(i+k+1) = OutHead(h_i^k) with
    the shared (here tied) embedding and head; L^k = mean over i of −log P^k_(i+k+1)[t_(i+k+1)] (the
    paper divides by T, moefold and Megatron-Core by the T−k targets); L = L_main + λ·mean_k L^k."""
    from moefold.train.loss import build_objective

    cfg = load_config("tiny-deepseek", {"model.mtp_layers": "3", "model.tie_embeddings": "true",
                                        "model.mtp_loss_weight": "0.25"})
    model = build_model(cfg, vocab_size=40)
    model.init_weights(seed=0)
    T = 9
    tokens = torch.randint(0, 40, (2, T + 1), generator=torch.Generator().manual_seed(0))
    loss, parts = build_objective(model)(model, tokens[:, :T], tokens[:, 1:])

    emb, head = model.tok_embeddings, model.output
    assert head.weight is emb.weight
    h, (cos, sin) = model.trunk(tokens[:, :T])  # h^0: the main model's last block, before its norm
    depth_losses = []
    for k, module in enumerate(model.mtp.layers, start=1):
        n = T - k  # positions i = 1..T−k (0-based 0..T−k−1)
        merged = torch.cat([module.enorm(emb(tokens[:, k:k + n])), module.hnorm(h[:, :n])], dim=-1)
        h = module.block(module.eh_proj(merged), cos[:n], sin[:n])
        logits = head(module.norm(h))  # predicts t_(i+k+1), i.e. tokens[:, i + k + 1] 0-based
        depth_losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1:k + 1 + n].flatten()))
    main = F.cross_entropy(model(tokens[:, :T]).flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(parts["mtp_loss"], torch.stack(depth_losses).mean())
    torch.testing.assert_close(loss, main + 0.25 * torch.stack(depth_losses).mean())


def test_an_mtp_loss_weight_without_mtp_modules_is_refused():
    """Without MTP modules the objective is the next-token loss alone: the weight trained bit for
    bit as without it."""
    with pytest.raises(ConfigError, match=r"^model.mtp_loss_weight=0.1 needs model.mtp_layers > 0"):
        load_config("tiny-qwen3", {"model.mtp_loss_weight": "0.1"})
    load_config("tiny-qwen3", {"model.mtp_loss_weight": "0.1", "model.mtp_layers": "1"})
    load_config("deepseek-v3", {"model.mtp_layers": "0"})  # the preset states the default weight


@pytest.mark.parametrize("key", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_an_mla_head_size_under_gqa_is_refused(key):
    """GQA's heads are head_dim wide and rotate all of it: MLA's sizes there trained bit for bit as
    without them (model.q_lora_rank was already refused)."""
    with pytest.raises(ConfigError, match=f"^model.{key}=6 needs model.attention='mla'"):
        load_config("tiny-qwen3", {f"model.{key}": "6"})
    load_config("tiny-deepseek", {f"model.{key}": "6"})


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek"])
def test_norm_eps_reaches_every_rmsnorm_but_mla_latents(preset):
    """model.norm_eps is transformers' rms_norm_eps: the block, final, QK and MTP norms take it;
    MLA's latent norms keep 1e-6 (DeepSeek-V3's q_a_layernorm/kv_a_layernorm are built without it)."""
    from moefold.models.norm import RMSNorm

    model = build_model(load_config(preset, {"model.norm_eps": "0.001"}), vocab_size=40)
    eps = {name: m.eps for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    latent = {n for n in eps if n.endswith(("attn.q_norm", "attn.kv_norm")) and preset == "tiny-deepseek"}
    assert eps and all(eps[n] == 1e-6 for n in latent) and all(eps[n] == 1e-3 for n in eps.keys() - latent)
    assert len(eps) - len(latent) >= 2 * len(model.blocks()) + 1
