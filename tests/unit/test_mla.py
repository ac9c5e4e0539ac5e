"""MLA and YaRN RoPE against transformers' DeepSeek-V3 (parity of outputs and gradients), plus
checks that need no transformers: plain RoPE unchanged, interleaved RoPE, causality."""

import math

import pytest
import torch

from moefold.models.mla import MLAttention
from moefold.models.rope import (RopeScaling, apply_rope, apply_rope_interleaved, rope_cos_sin,
                                 yarn_softmax_scale_factor)

DIM, HEADS, KV_LORA, NOPE, ROPE, V = 64, 4, 32, 16, 16, 12  # ROPE 16: the YaRN ramp spans dims 2..6
THETA, SEQ = 10000.0, 12
# transformers' module name -> ours
HF_TO_MOEFOLD = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
                 "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
                 "o_proj": "wo"}
SCALINGS = {
    "none": None,
    "yarn": RopeScaling(factor=4.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0),
    "yarn_mscale_ne_all_dim": RopeScaling(factor=4.0, original_max_len=4096, mscale=0.707, mscale_all_dim=1.0),
    "yarn_no_all_dim": RopeScaling(factor=4.0, original_max_len=4096, mscale=1.0, mscale_all_dim=0.0),
}


def _assert_close_rel(actual, expected, rtol):
    """Elementwise within rtol, or within rtol of the tensor's largest entry (for entries near 0)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# ---- plain and interleaved RoPE (no transformers needed) ----

def test_plain_rope_tables_unchanged():
    """The formula rope_cos_sin had before YaRN, copied here: other models depend on it bit for bit."""
    for seq_len, head_dim, theta in [(10, 8, 10000.0), (37, 64, 1e6), (5, 128, 500000.0)]:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        for cos, sin in (rope_cos_sin(seq_len, head_dim, theta),
                         rope_cos_sin(seq_len, head_dim, theta, scaling=None)):
            assert cos.dtype == sin.dtype == torch.float32
            assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


def test_interleaved_rope_is_deinterleave_then_rotate_half():
    x = torch.randn(2, 3, SEQ, ROPE)
    cos, sin = rope_cos_sin(SEQ, ROPE, THETA)
    deinterleaved = x.view(2, 3, SEQ, ROPE // 2, 2).transpose(-1, -2).reshape(2, 3, SEQ, ROPE)
    torch.testing.assert_close(apply_rope_interleaved(x, cos, sin), apply_rope(deinterleaved, cos, sin),
                               rtol=0, atol=0)


def test_yarn_scores_depend_only_on_relative_position():
    cos, sin = rope_cos_sin(40, ROPE, THETA, scaling=SCALINGS["yarn_mscale_ne_all_dim"])
    q, k = torch.randn(1, 1, 1, ROPE).expand(1, 1, 40, ROPE), torch.randn(1, 1, 1, ROPE).expand(1, 1, 40, ROPE)
    scores = apply_rope_interleaved(q, cos, sin)[0, 0] @ apply_rope_interleaved(k, cos, sin)[0, 0].T
    assert scores[5, 2].item() == pytest.approx(scores[30, 27].item(), rel=1e-4)


def test_softmax_scale_factor_is_deepseek_mscale_squared():
    assert yarn_softmax_scale_factor(None) == 1.0
    assert yarn_softmax_scale_factor(SCALINGS["yarn_no_all_dim"]) == 1.0
    assert yarn_softmax_scale_factor(RopeScaling(1.0, 4096, mscale_all_dim=1.0)) == 1.0
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert yarn_softmax_scale_factor(RopeScaling(40.0, 4096, mscale_all_dim=0.707)) == pytest.approx(mscale ** 2)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_is_causal(q_lora_rank):
    torch.manual_seed(0)
    attn = MLAttention(DIM, HEADS, q_lora_rank, KV_LORA, NOPE, ROPE, V, 1e-6)
    cos, sin = rope_cos_sin(SEQ, ROPE, THETA)
    x = torch.randn(2, SEQ, DIM)
    x_changed = x.clone()
    x_changed[:, 7:] = torch.randn(2, SEQ - 7, DIM)
    out, out_changed = attn(x, cos, sin), attn(x_changed, cos, sin)
    assert out.shape == (2, SEQ, DIM)
    torch.testing.assert_close(out[:, :7], out_changed[:, :7])
    assert not torch.allclose(out[:, 7:], out_changed[:, 7:])


# ---- parity with transformers' DeepseekV3Attention ----

def _hf_config(q_lora_rank: int, interleave: bool, scaling: RopeScaling | None):
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "default", "rope_theta": THETA}
    if scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": THETA, "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_len, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    return transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=DIM, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank or None, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, max_position_embeddings=16384, rms_norm_eps=1e-6, rope_interleave=interleave,
        rope_parameters=rope, attn_implementation="eager", torch_dtype=torch.float32)


def _hf_pair(q_lora_rank: int, interleave: bool, scaling: RopeScaling | None):
    """transformers' attention and rotary embedding with random weights, and our MLA holding a copy."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = _hf_config(q_lora_rank, interleave, scaling)
    torch.manual_seed(0)
    hf_attn = hf.DeepseekV3Attention(config, layer_idx=0).float()
    with torch.no_grad():
        for p in hf_attn.parameters():  # norms too, so a swapped weight cannot hide behind ones
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    ours = MLAttention(DIM, HEADS, q_lora_rank, KV_LORA, NOPE, ROPE, V, 1e-6,
                       softmax_scale_factor=yarn_softmax_scale_factor(scaling), interleaved_rope=interleave)
    hf_state = hf_attn.state_dict()
    ours_state = {f"{HF_TO_MOEFOLD[k.split('.')[0]]}.{k.split('.', 1)[1]}": v for k, v in hf_state.items()}
    ours.load_state_dict(ours_state, strict=True)
    return hf_attn, hf.DeepseekV3RotaryEmbedding(config), ours


def _causal_additive_mask(seq_len: int) -> torch.Tensor:
    return torch.full((seq_len, seq_len), torch.finfo(torch.float32).min).triu(1)[None, None]


@pytest.mark.parametrize("scaling_name", list(SCALINGS))
def test_rope_tables_and_softmax_scale_match_transformers(scaling_name):
    scaling = SCALINGS[scaling_name]
    hf_attn, hf_rotary, _ = _hf_pair(0, True, scaling)
    x = torch.zeros(1, SEQ, DIM)
    hf_cos, hf_sin = hf_rotary(x, torch.arange(SEQ)[None])
    cos, sin = rope_cos_sin(SEQ, ROPE, THETA, scaling=scaling)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)
    assert NOPE + ROPE == hf_attn.qk_head_dim
    assert (NOPE + ROPE) ** -0.5 * yarn_softmax_scale_factor(scaling) == pytest.approx(hf_attn.scaling, rel=1e-12)


@pytest.mark.parametrize("scaling_name", list(SCALINGS))
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_matches_transformers(q_lora_rank, interleave, scaling_name):
    scaling = SCALINGS[scaling_name]
    hf_attn, hf_rotary, ours = _hf_pair(q_lora_rank, interleave, scaling)
    x_hf = torch.randn(2, SEQ, DIM, requires_grad=True)
    x_ours = x_hf.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, SEQ, DIM)

    out_hf, _ = hf_attn(x_hf, hf_rotary(x_hf, torch.arange(SEQ)[None].expand(2, SEQ)), _causal_additive_mask(SEQ))
    cos, sin = rope_cos_sin(SEQ, ROPE, THETA, scaling=scaling)
    out_ours = ours(x_ours, cos, sin)
    _assert_close_rel(out_ours, out_hf, rtol=1e-5)

    out_hf.backward(grad_out)
    out_ours.backward(grad_out)
    _assert_close_rel(x_ours.grad, x_hf.grad, rtol=1e-4)
    ours_params = dict(ours.named_parameters())
    for name, p in hf_attn.named_parameters():
        module, leaf = name.split(".", 1)
        _assert_close_rel(ours_params[f"{HF_TO_MOEFOLD[module]}.{leaf}"].grad, p.grad, rtol=1e-4)


def test_flops_dims():
    attn = MLAttention(DIM, HEADS, 0, KV_LORA, NOPE, ROPE, V, 1e-6)
    assert attn.attention_flops_dims() == (HEADS, NOPE + ROPE, V)
    assert (attn.n_heads, attn.qk_head_dim, attn.v_head_dim) == (HEADS, NOPE + ROPE, V)
