"""Audit 7 of the models against transformers where the other parity tests do not reach: sliding
windows at and around the sequence length with the KV cache, GQA ratios 1 and H and head_dim ≠
dim / heads, YaRN with its ramp in effect past the pre-training length (mscale, mscale_all_dim,
truncate, a null factor, the legacy `type` key), rope_theta extremes, DeepSeek-V3's layer pattern,
shared experts and head sizes, the RoPE types moefold refuses, and bf16 RoPE against fp64. The
reference is transformers' eager model on the same weights (its full forward, never its cache), or
fp64 arithmetic.

B batch, S sequence, V vocabulary, P positions already cached.
"""


import pytest
import torch
import torch.nn.functional as F

from moefold.checkpoint.hf import config_from_hf, hf_tensors, load_pretrained
from moefold.errors import CheckpointError
from moefold.models import transformer as transformer_module
from moefold.models.rope import apply_rope, apply_rope_interleaved, rope_cos_sin
from test_hf_interop import deepseek_v3, hub_named, mixtral, randomize

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 96
FP32_RTOL = 1e-5


def qwen3(**kw):  # two layers, where test_hf_interop's qwen3 has three
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                num_experts=6, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def _pair(hf_config, tmp_path, seed=0):
    """(transformers' eager fp32 model, moefold's model loaded from the checkpoint it saved)."""
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(hf, seed)
    hf.save_pretrained(tmp_path)
    return hf.eval(), load_pretrained(tmp_path)


def _ids(seq_len: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _assert_rel_close(actual, expected, rtol, what, atol=0.0):
    """Within rtol of the largest entry; `atol` for a tensor that is 0 in exact arithmetic (a top-1
    router's weight gradient: the renormalised probability is 1 whatever its logits)."""
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= rtol * max(scale, 1e-6) + atol, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _decoded_in_pieces(model, ids_BS: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    """moefold's logits of `ids_BS` read through its KV cache, `pieces` tokens per decode call."""
    cache = model.new_cache(ids_BS.shape[1])
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    return torch.cat([model.decode(ids_BS[:, s:s + n], cache) for s, n in zip(starts, pieces, strict=True)], 1)


def _assert_forward_and_decode_match(hf_config, tmp_path, seq_len, pieces):
    hf, ours = _pair(hf_config, tmp_path)
    ids = _ids(seq_len)
    with torch.no_grad():
        expected = hf(ids).logits
        _assert_rel_close(ours(ids), expected, FP32_RTOL, "forward logits")
    _assert_rel_close(_decoded_in_pieces(ours, ids, pieces), expected, FP32_RTOL, "decoded logits")


# ---------------------------------------------------------------------------------------------
# Sliding windows and GQA shapes, forward and through the KV cache
# ---------------------------------------------------------------------------------------------

SEQ = 20
PIECES = [7, 1, 1, 5, 6]  # a prefill, single tokens, chunks: every mask form at an offset


@pytest.mark.parametrize("make", [
    lambda w: mixtral(sliding_window=w),
    lambda w: qwen3(use_sliding_window=True, sliding_window=w)], ids=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("window", [3, SEQ - 1, SEQ, SEQ + 1])
def test_a_sliding_window_around_the_sequence_length_matches_transformers_forward_and_cached(
        make, window, tmp_path):
    _assert_forward_and_decode_match(make(window), tmp_path, SEQ, PIECES)


@pytest.mark.parametrize("hf_config", [
    qwen3(num_key_value_heads=1), qwen3(num_key_value_heads=4), qwen3(head_dim=16),
    mixtral(head_dim=12), mixtral(num_key_value_heads=1, head_dim=4)],
    ids=["qwen3-mqa", "qwen3-mha", "qwen3-head_dim16", "mixtral-head_dim12", "mixtral-mqa-head_dim4"])
def test_gqa_ratios_and_head_dims_match_transformers_forward_and_cached(hf_config, tmp_path):
    _assert_forward_and_decode_match(hf_config, tmp_path, SEQ, [5, 15])


# ---------------------------------------------------------------------------------------------
# RoPE: YaRN with its ramp in effect, past the pre-training length; theta extremes
# ---------------------------------------------------------------------------------------------

# theta 100 over 32 rotated dims with 64 pre-training positions puts YaRN's ramp on dims 0..9 of
# 16 (unrounded: 0..8.07), so interpolation, extrapolation and the blend all show; 80 > 64 tokens.
ORIGINAL, YARN_SEQ = 64, 80


def _yarn(**kw):
    return {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
            **kw}


YARNS = {"plain": _yarn(), "mscale": _yarn(mscale=0.707), "mscale_all_dim": _yarn(mscale_all_dim=1.0),
         "both": _yarn(mscale=1.0, mscale_all_dim=0.8), "truncate_false": _yarn(truncate=False),
         "betas": _yarn(beta_fast=8.0, beta_slow=2.0), "factor_null": _yarn(factor=None),
         "factor_not_max_over_original": _yarn(factor=3.0),
         "legacy_type_key": {"type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                             "original_max_position_embeddings": ORIGINAL, "mscale": 1.0, "mscale_all_dim": 1.0}}
YARN_FAMILIES = {"qwen3_moe": lambda rope: qwen3(head_dim=32, rope_parameters=rope, max_position_embeddings=256),
                 "deepseek_v3": lambda rope: deepseek_v3(qk_rope_head_dim=32, rope_parameters=rope,
                                                         max_position_embeddings=256),
                 "deepseek_v3-no_interleave": lambda rope: deepseek_v3(qk_rope_head_dim=32, rope_parameters=rope,
                                                                       max_position_embeddings=256,
                                                                       rope_interleave=False)}


@pytest.mark.parametrize("family", YARN_FAMILIES)
@pytest.mark.parametrize("yarn", YARNS)
def test_yarn_past_the_pretraining_length_matches_transformers_forward_and_cached(family, yarn, tmp_path):
    _assert_forward_and_decode_match(YARN_FAMILIES[family](dict(YARNS[yarn])), tmp_path, YARN_SEQ, [60, 1, 19])


@pytest.mark.parametrize("make", [qwen3, deepseek_v3], ids=["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("theta", [2.0, 1e12])
def test_rope_theta_extremes_match_transformers(make, theta, tmp_path):
    _assert_forward_and_decode_match(make(rope_parameters={"rope_type": "default", "rope_theta": theta}),
                                     tmp_path, SEQ, [12, 8])


def test_rope_tables_far_past_the_pretraining_length_are_transformers_bit_for_bit():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    positions = torch.tensor([0, 1, 4095, 32767, 32768, 70000, 131071])
    for rope in ({"rope_type": "default", "rope_theta": 1e6},
                 {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768,
                  "mscale": 1.0, "mscale_all_dim": 0.8}):
        hf_config = qwen3(head_dim=128, rope_parameters=dict(rope), max_position_embeddings=131072)
        model = transformer_module.build_model(config_from_hf(hf_config.to_dict()), VOCAB)
        cos, sin = model.rope(131072, "cpu")
        hf_cos, hf_sin = Qwen3MoeRotaryEmbedding(hf_config)(torch.zeros(1), positions[None])
        assert torch.equal(cos[positions], hf_cos[0]) and torch.equal(sin[positions], hf_sin[0]), rope["rope_type"]


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
     "original_max_position_embeddings": 8192},
    {"type": "linear", "factor": 2.0}], ids=["linear", "dynamic", "llama3", "longrope", "legacy-linear"])
@pytest.mark.parametrize("make", [qwen3, mixtral, deepseek_v3], ids=["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_rope_type_moefold_does_not_compute_is_refused_by_its_key(make, rope):
    config = make().to_dict()
    config["rope_scaling"] = {"rope_theta": 10000.0, **rope}
    with pytest.raises(CheckpointError, match=r"rope_scaling\.rope_type='\w+' is not supported \(default, yarn\)"):
        config_from_hf(config)


def test_a_yarn_attention_factor_is_refused_by_its_key():
    config = qwen3().to_dict()
    config["rope_scaling"] = _yarn(attention_factor=1.3)
    with pytest.raises(CheckpointError, match=r"rope_scaling\.attention_factor=1\.3 is not supported"):
        config_from_hf(config)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's layer pattern, shared experts and head sizes; tied heads (logits and gradients)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_config", [
    deepseek_v3(n_shared_experts=2), deepseek_v3(first_k_dense_replace=0),
    deepseek_v3(first_k_dense_replace=5), deepseek_v3(routed_scaling_factor=1.0, norm_topk_prob=False),
    deepseek_v3(qk_nope_head_dim=0, v_head_dim=12), deepseek_v3(qk_nope_head_dim=4, v_head_dim=12, q_lora_rank=6),
    deepseek_v3(tie_word_embeddings=True, rope_interleave=False),
    deepseek_v3(n_group=4, topk_group=1, num_experts_per_tok=2),
    mixtral(tie_word_embeddings=True, num_experts_per_tok=1), qwen3(num_experts_per_tok=6, norm_topk_prob=True),
    qwen3(rms_norm_eps=1e-2)],
    ids=["ds-shared2", "ds-first_k0", "ds-first_k_past_layers", "ds-scale1-unnormed", "ds-nope0-v12",
         "ds-nope4-v12-q_lora", "ds-tied-no_interleave", "ds-one_group_of_4", "mixtral-tied-top1",
         "qwen3-top_all-normed", "qwen3-qk_norm_eps"])
def test_model_variants_match_transformers_logits_and_gradients(hf_config, tmp_path):
    hf, ours = _pair(hf_config, tmp_path)
    ids, labels = _ids(SEQ), _ids(SEQ, seed=2)
    hf_logits, our_logits = hf(ids).logits, ours(ids)
    _assert_rel_close(our_logits.detach(), hf_logits.detach(), FP32_RTOL, "logits")
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()
    hf_grads = hub_named({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, hf_config.model_type)
    our_grads = dict(hf_tensors(ours, {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}))
    assert hf_grads.keys() <= our_grads.keys()
    for name, grad in hf_grads.items():
        _assert_rel_close(our_grads[name], grad, 1e-4, f"grad {name}", atol=1e-7)


# ---------------------------------------------------------------------------------------------
# bf16: RoPE rotates in fp32 and rounds once (transformers rounds the tables, then each product)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotate", [apply_rope, apply_rope_interleaved], ids=["rotate_half", "interleaved"])
def test_bf16_rope_is_the_fp64_rotation_rounded_once(rotate):
    """Within one bf16 ulp of the exact rotation of the bf16 input by the fp32 tables: the
    accuracy transformers' bf16 RoPE (cos/sin cast to bf16, each product rounded) does not keep."""
    gen = torch.Generator().manual_seed(0)
    x_BHSD = (torch.randn(2, 3, 64, 32, generator=gen) * 4).bfloat16()
    cos_SD, sin_SD = rope_cos_sin(64, 32, 10000.0)
    x = x_BHSD.double()
    if rotate is apply_rope_interleaved:  # the pairs (0, 1), (2, 3), ... land in rotate-half order
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    exact = x * cos_SD.double() + torch.cat([-x2, x1], dim=-1) * sin_SD.double()
    got = rotate(x_BHSD, cos_SD, sin_SD)
    assert got.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((got.double() - exact).abs() <= ulp).all()


# ---------------------------------------------------------------------------------------------
# Decoding: RoPE tables for the new positions only
# ---------------------------------------------------------------------------------------------


def test_rope_tables_from_an_offset_are_the_rows_of_the_whole_table():
    full_cos, full_sin = rope_cos_sin(300, 16, 10000.0)
    cos, sin = rope_cos_sin(5, 16, 10000.0, start=295)
    assert torch.equal(cos, full_cos[295:]) and torch.equal(sin, full_sin[295:])


def test_decode_builds_rope_tables_for_its_new_positions_only(tmp_path, monkeypatch):
    """A decode step after P cached tokens rotates S new ones: tables of P + S rows (sliced to S)
    made each generated token cost O(P) table work, 0.8 s a token at P = 131072 on CPU."""
    hf, ours = _pair(qwen3(), tmp_path)
    ids = _ids(SEQ)
    rows_built = []
    real = transformer_module.rope_cos_sin
    monkeypatch.setattr(transformer_module, "rope_cos_sin",
                        lambda seq_len, *a, **kw: rows_built.append(seq_len) or real(seq_len, *a, **kw))
    decoded = _decoded_in_pieces(ours, ids, [16, 1, 3])
    assert rows_built == [16, 1, 3]
    with torch.no_grad():
        _assert_rel_close(decoded, hf(ids).logits, FP32_RTOL, "decoded logits")
