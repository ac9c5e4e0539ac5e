"""Edges of the presets and of what is built and counted from them: configs of very many layers,
and the families without a Hugging Face conversion against transformers' own models."""

import time

import pytest

from moefold.config import load_config


@pytest.mark.parametrize("preset, overrides", [
    ("deepseek-v3", {}),
    ("tiny", {"memory.recompute": '["mlp", "moe_act"]'}),  # the checks that ask for dense / MoE layers
    ("tiny", {"moe.first_k_dense": "0", "moe.dense_layers": "[99999999]", "memory.recompute": '["mlp"]'}),
])
def test_a_config_of_very_many_layers_validates_without_visiting_each(preset, overrides):
    """`config params` and `plan memory` count a 10^8-layer model from one block of each kind; the
    config's own checks (is there a dense MLP, a shared expert to split over TP, ...) must not
    visit each layer either (they did, in 2 lists of 10^8: minutes before any output)."""
    start = time.perf_counter()
    cfg = load_config(preset, {"model.n_layers": "100000000", **overrides})
    assert time.perf_counter() - start < 2
    assert cfg.model.n_layers == 10**8


def test_a_dense_layer_of_very_many_is_found():
    """The one dense layer among 10^8 MoE layers still makes 'mlp' a site memory.recompute can
    wrap; with none, it is refused as before."""
    layers = {"model.n_layers": "100000000", "moe.first_k_dense": "0", "memory.recompute": '["mlp"]'}
    load_config("tiny", {**layers, "moe.dense_layers": "[99999999]"})
    with pytest.raises(Exception, match="no dense MLP layer"):
        load_config("tiny", layers)


# ---------------------------------------------------------------------------------------------
# deepseek_v2 and olmoe have no Hugging Face conversion (test_hf_interop covers the three that
# do): their presets' structure, shrunk, against transformers' DeepseekV2 and Olmoe models, the
# weights carried across under the names of the family that shares their layout.
# ---------------------------------------------------------------------------------------------

VOCAB = 96


def _random_model(cfg):
    import math

    import torch

    from moefold.models.transformer import build_model

    model = build_model(cfg, VOCAB).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            noise = torch.randn(t.shape, generator=gen)
            t.copy_(1 + 0.2 * noise if t.dim() == 1 else noise / math.sqrt(t.shape[-2 if t.dim() == 3 else -1]))
    return model


def _load_into(hf, hub: dict) -> None:
    """transformers' fused in-memory experts from the Hub's per-expert tensors."""
    import torch

    state = {}
    for name in hf.state_dict():
        base = name.rsplit(".", 1)[0]
        n = sum(1 for k in hub if k.startswith(f"{base}.") and k.endswith(".down_proj.weight"))
        if name.endswith("experts.gate_up_proj"):
            state[name] = torch.stack([torch.cat([hub[f"{base}.{e}.gate_proj.weight"], hub[f"{base}.{e}.up_proj.weight"]])
                                       for e in range(n)])
        elif name.endswith("experts.down_proj"):
            state[name] = torch.stack([hub[f"{base}.{e}.down_proj.weight"] for e in range(n)])
        else:
            state[name] = hub[name]
    hf.load_state_dict(state, strict=True)


def _assert_same_logits(ours, hf):
    import torch

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_deepseek_v2_lite_structure_matches_transformers():
    """MLA without query compression, YaRN with mscale = mscale_all_dim = 0.707 (tables unscaled,
    softmax scale times mscale²), a dense first layer, 2 shared experts, softmax top-6 unnormalised."""
    transformers = pytest.importorskip("transformers")
    from moefold.checkpoint.hf import hf_tensors

    sizes = {"model.dim": "32", "model.n_layers": "3", "model.n_heads": "4", "model.ffn_hidden": "48",
             "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "8", "model.qk_rope_head_dim": "8",
             "model.v_head_dim": "8", "model.rope_original_max_len": "8", "moe.num_experts": "8",
             "moe.expert_hidden": "16"}
    cfg = load_config("deepseek-v2-lite", sizes)
    m, moe = cfg.model, cfg.moe
    cfg.model.family = "deepseek_v3"  # the same tensor names
    ours = _random_model(cfg)
    hf_config = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=m.dim, intermediate_size=m.ffn_hidden, moe_intermediate_size=moe.expert_hidden,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
        n_shared_experts=moe.shared_experts, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        first_k_dense_replace=moe.first_k_dense, kv_lora_rank=m.kv_lora_rank, q_lora_rank=None,
        qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim,
        topk_method="greedy", norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.routed_scaling_factor,
        rms_norm_eps=m.norm_eps, max_position_embeddings=int(m.rope_original_max_len * m.rope_factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.rope_factor,
                         "original_max_position_embeddings": m.rope_original_max_len, "beta_fast": m.yarn_beta_fast,
                         "beta_slow": m.yarn_beta_slow, "mscale": m.yarn_mscale,
                         "mscale_all_dim": m.yarn_mscale_all_dim})
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _load_into(hf, dict(hf_tensors(ours)))
    _assert_same_logits(ours, hf)


def test_olmoe_structure_matches_transformers_with_one_head():
    """OLMoE's QK-norm spans the whole projection, ours each head (the preset says so): with one
    head they are the same, and the rest (softmax top-8 unnormalised, eps 1e-5) must match."""
    transformers = pytest.importorskip("transformers")
    from moefold.checkpoint.hf import hf_tensors

    sizes = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "1", "model.n_kv_heads": "1",
             "model.head_dim": "32", "moe.num_experts": "16", "moe.expert_hidden": "16"}
    cfg = load_config("olmoe-1b-7b", sizes)
    m, moe = cfg.model, cfg.moe
    cfg.model.family = "qwen3_moe"  # the same tensor names
    ours = _random_model(cfg)
    hf_config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=m.dim, intermediate_size=moe.expert_hidden, num_hidden_layers=m.n_layers,
        num_attention_heads=1, num_key_value_heads=1, num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        max_position_embeddings=64)
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _load_into(hf, dict(hf_tensors(ours)))
    _assert_same_logits(ours, hf)
