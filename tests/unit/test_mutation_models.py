"""Tests written from mutation testing of models/ and checkpoint/hf*: each kills mutants of the source
(a changed operator, a swapped argument, a wrong default) that the rest of the suite let through.
References: transformers' own config classes and rotary embeddings (the strongest), or naive code."""

import json

import pytest
import torch

from moefold.checkpoint.hf import config_from_hf
from moefold.models.transformer import build_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SEQ = 40

# ---------------------------------------------------------------------------------------------
# YaRN through config.json: the model's RoPE tables and softmax scale are transformers'
# ---------------------------------------------------------------------------------------------

_YARN_CASES = {  # the mscale pairs transformers reads differently, and non-default betas
    "mscale_ne_all_dim": {"mscale": 0.707, "mscale_all_dim": 1.0},
    "mscale_without_all_dim": {"mscale": 0.707, "mscale_all_dim": 0.0},
    "all_dim_without_mscale": {"mscale": 0.0, "mscale_all_dim": 0.8},
    "betas": {"beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def _deepseek_hf_config(**rope):
    return transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12, max_position_embeddings=16384,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 4096, **rope})  # ramp over dims 2..6


@pytest.mark.parametrize("case", list(_YARN_CASES))
def test_yarn_from_config_json_gives_transformers_tables_and_softmax_scale(case):
    """config.json -> Config -> model: cos/sin and the MLA softmax scale equal transformers'
    DeepseekV3RotaryEmbedding and DeepseekV3Attention.scaling for each mscale pairing
    (kills: mscale not passed to the model, the ratio used when one of the pair is 0)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    hf_config = _deepseek_hf_config(**_YARN_CASES[case])
    cfg = config_from_hf(json.loads(hf_config.to_json_string()))
    with torch.device("meta"):
        model = build_model(cfg, 32)
    cos, sin = model.rope(SEQ, "cpu")
    hf_cos, hf_sin = hf.DeepseekV3RotaryEmbedding(hf_config)(torch.zeros(1, SEQ, 64), torch.arange(SEQ)[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sin, hf_sin[0], rtol=1e-6, atol=1e-7)
    hf_scaling = hf.DeepseekV3Attention(hf_config, layer_idx=0).scaling
    assert model.layers[0].attn.softmax_scale == pytest.approx(hf_scaling, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# config.json without the optional keys: the defaults are those of transformers' config classes
# ---------------------------------------------------------------------------------------------

_MINIMAL = {  # only what each config class has no default for that moefold needs (sizes)
    "qwen3_moe": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "use_sliding_window": True},
    "mixtral": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
                "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
                    "intermediate_size": 48, "n_routed_experts": 16, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 8},
}


def _ours_and_theirs(model_type: str) -> tuple[dict, dict]:
    """(our Config's fields, the same read from transformers' config class) for a minimal config.json."""
    minimal = _MINIMAL[model_type]
    hf = transformers.CONFIG_MAPPING[model_type](**minimal)
    cfg = config_from_hf({"model_type": model_type, **minimal})
    m, moe = cfg.model, cfg.moe
    ours = {"norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "tie_embeddings": m.tie_embeddings,
            "init_std": m.init_std, "top_k": moe.top_k}
    theirs = {"norm_eps": hf.rms_norm_eps, "rope_theta": hf.rope_parameters["rope_theta"],
              "tie_embeddings": hf.tie_word_embeddings, "init_std": hf.initializer_range,
              "top_k": hf.num_experts_per_tok}
    if model_type != "deepseek_v3":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        ours.update(n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, sliding_window=m.sliding_window,
                    aux_loss_coeff=moe.aux_loss_coeff)
        theirs.update(n_kv_heads=hf.num_key_value_heads, head_dim=head_dim, sliding_window=hf.sliding_window or 0,
                      aux_loss_coeff=hf.router_aux_loss_coef)
    if model_type == "qwen3_moe":  # layer i is MoE iff (i + 1) % decoder_sparse_step == 0
        ours.update(norm_topk_prob=moe.norm_topk_prob, first_k_dense=moe.first_k_dense, moe_every=moe.moe_every)
        theirs.update(norm_topk_prob=hf.norm_topk_prob, first_k_dense=hf.decoder_sparse_step - 1,
                      moe_every=hf.decoder_sparse_step)
    if model_type == "mixtral":
        ours.update(input_jitter=moe.input_jitter)
        theirs.update(input_jitter=hf.router_jitter_noise)
    if model_type == "deepseek_v3":
        ours.update(q_lora_rank=m.q_lora_rank, rope_interleaved=m.rope_interleaved, mtp_layers=m.mtp_layers,
                    first_k_dense=moe.first_k_dense, shared_experts=moe.shared_experts,
                    routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
                    num_groups=moe.num_groups, group_top_k=moe.group_top_k)
        theirs.update(q_lora_rank=hf.q_lora_rank or 0, rope_interleaved=hf.rope_interleave,
                      mtp_layers=hf.num_nextn_predict_layers, first_k_dense=hf.first_k_dense_replace,
                      shared_experts=hf.n_shared_experts, routed_scaling_factor=hf.routed_scaling_factor,
                      norm_topk_prob=hf.norm_topk_prob, num_groups=hf.n_group, group_top_k=hf.topk_group)
    return ours, theirs


@pytest.mark.parametrize("model_type", list(_MINIMAL))
def test_a_config_json_without_optional_keys_reads_as_transformers_defaults(model_type):
    """Every default `config_from_hf` fills in is the value transformers builds the model with
    (kills: DeepSeek's first_k_dense_replace, routed_scaling_factor, norm_topk_prob, rope_interleave,
    Qwen3's num_key_value_heads, norm_topk_prob and window, Mixtral's rope_theta, ... defaults)."""
    ours, theirs = _ours_and_theirs(model_type)
    assert ours == theirs


# ---------------------------------------------------------------------------------------------
# Attention masks at every offset: SDPA with the mask's arguments equals a naive masked softmax
# ---------------------------------------------------------------------------------------------


def _naive_attention(q_SD, k_PD, v_PD, start: int, window: int) -> torch.Tensor:
    """Query start + i attends keys j with 0 <= (start + i) - j < window (window 0: no limit)."""
    distance_SP = (start + torch.arange(q_SD.shape[0]))[:, None] - torch.arange(k_PD.shape[0])[None, :]
    allowed_SP = (distance_SP >= 0) & ((distance_SP < window) if window else True)
    scores_SP = (q_SD @ k_PD.T / q_SD.shape[-1] ** 0.5).masked_fill(~allowed_SP, float("-inf"))
    return scores_SP.softmax(-1) @ v_PD


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_masks_at_every_offset_give_naive_attention(window):
    """causal_mask / SlidingWindowMask(start, S) for every cached length and every new-token count,
    the cases generation meets (kills: a fused is_causal at a non-zero start, a missing mask for 2
    new tokens, the window's bounds off by one)."""
    import torch.nn.functional as F

    from moefold.models.attention import SlidingWindowMask, causal_mask

    mask = SlidingWindowMask(window) if window else causal_mask
    gen = torch.Generator().manual_seed(0)
    for start in range(5):
        for num_new in range(1, 5):
            P = start + num_new
            q, k, v = (torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in (num_new, P, P))
            got = F.scaled_dot_product_attention(q[None], k[None], v[None], **mask(start, num_new, "cpu"))[0]
            torch.testing.assert_close(got, _naive_attention(q, k, v, start, window),
                                       msg=lambda m, s=start, n=num_new: f"start {s}, {n} new: {m}")
