"""config.json import against transformers 5 building the model from the same file (tiny random
models: moefold's logits are transformers'), and the chunked loss of fp64 inputs against the plain
fp64 cross-entropy."""

import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_interop import VOCAB, assert_rel_close, hf_model_of  # noqa: E402

from moefold.checkpoint.hf import config_from_hf, load_pretrained, save_pretrained  # noqa: E402
from moefold.data import IGNORE_INDEX  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402
from moefold.train.chunked_loss import (  # noqa: E402
    chunk_loss_and_grad, chunked_linear_cross_entropy, fused_chunk_loss_and_grad)
from moefold.train.loss import cross_entropy_loss  # noqa: E402

SEQ = 40  # past YaRN's original lengths below

QWEN = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2)
MIXTRAL = dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                num_nextn_predict_layers=0)
FAMILIES = {"qwen3_moe": QWEN, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK}


def _transformers_of(config: dict, path: Path) -> transformers.PreTrainedModel:
    """transformers' random model of the config.json `config`, saved to `path` under that very
    config.json (not the one save_pretrained standardises)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_model_of(transformers.AutoConfig.from_pretrained(path), seed=3)
        hf.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return hf


def _assert_imports_as_transformers_builds(config: dict, path: Path) -> None:
    hf = _transformers_of(config, path)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours = load_pretrained(path)
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")


# ---------------------------------------------------------------------------------------------
# rope_scaling beside rope_parameters: transformers takes a non-empty rope_scaling whole
# ---------------------------------------------------------------------------------------------

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
_DEFAULT = {"rope_type": "default", "rope_theta": 500.0}
BOTH_KEYS = {
    "yarn_scaling_then_default_parameters": {"rope_scaling": _YARN, "rope_parameters": _DEFAULT},
    "default_parameters_then_yarn_scaling": {"rope_parameters": _DEFAULT, "rope_scaling": _YARN},
    "default_scaling_then_yarn_parameters": {"rope_scaling": _DEFAULT, "rope_parameters": _YARN},
    "yarn_parameters_then_default_scaling": {"rope_parameters": _YARN, "rope_scaling": _DEFAULT},
    "empty_scaling_then_yarn_parameters": {"rope_scaling": {}, "rope_parameters": _YARN},
    "null_scaling_then_yarn_parameters": {"rope_scaling": None, "rope_parameters": _YARN},
    "two_yarns_and_a_top_level_theta": {"rope_scaling": {**_YARN, "rope_theta": 700.0},
                                        "rope_parameters": {**_YARN, "factor": 2.0, "rope_theta": 5000.0},
                                        "rope_theta": 300.0},
    "a_top_level_original_length_over_rope_parameters": {"rope_parameters": _YARN,
                                                          "original_max_position_embeddings": 16,
                                                          "max_position_embeddings": 64},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("keys", BOTH_KEYS)
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(family, keys, tmp_path):
    """transformers 5 renamed rope_scaling to rope_parameters and, given both, takes rope_scaling
    when it is non-empty (its theta, else the top-level one's; never rope_parameters'), whichever
    comes first in the file; a top-level original_max_position_embeddings outranks the dict's."""
    _assert_imports_as_transformers_builds({**FAMILIES[family], **BOTH_KEYS[keys]}, tmp_path / "hf")


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE's layer pattern: Python's modulus, and sizes no layer uses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [-1, -2, -3])
def test_a_negative_decoder_sparse_step_is_its_magnitude_as_in_transformers(step, tmp_path):
    """Qwen3MoeDecoderLayer is MoE where (i + 1) % decoder_sparse_step == 0; Python's modulus by
    -s is 0 exactly where the one by s is, so -2 is every second layer (moefold refused it:
    'decoder_sparse_step=-2 must be > 0')."""
    _assert_imports_as_transformers_builds({**QWEN, "decoder_sparse_step": step}, tmp_path / "hf")


UNUSED_DENSE_WIDTH = {
    "qwen3_moe-every_layer_sparse-0": {**QWEN, "intermediate_size": 0},
    "qwen3_moe-every_layer_sparse-negative": {**QWEN, "intermediate_size": -5},
    "qwen3_moe-every_layer_sparse-absent": {k: v for k, v in QWEN.items() if k != "intermediate_size"},
    "qwen3_moe-step_-1-and_mlp_only_layers_of_no_layer": {**QWEN, "intermediate_size": 0, "decoder_sparse_step": -1,
                                                          "mlp_only_layers": [-1, 7]},
    "deepseek_v3-no_dense_layer": {**DEEPSEEK, "intermediate_size": 0, "first_k_dense_replace": 0},
}
UNUSED_EXPERT_SIZES = {
    "qwen3_moe-no_experts-0": {**QWEN, "num_experts": 0, "moe_intermediate_size": 0, "num_experts_per_tok": 0},
    "qwen3_moe-no_experts-absent": {k: v for k, v in QWEN.items() if k not in ("moe_intermediate_size",
                                                                             "num_experts_per_tok")}
    | {"num_experts": 0},
    "qwen3_moe-every_layer_mlp_only": {**QWEN, "mlp_only_layers": [0, 1, 2, 3], "moe_intermediate_size": -1},
    "deepseek_v3-every_layer_dense": {**DEEPSEEK, "first_k_dense_replace": 5, "moe_intermediate_size": 0,
                                      "num_experts_per_tok": 0},
}


@pytest.mark.parametrize("variant", UNUSED_DENSE_WIDTH)
def test_the_dense_mlp_width_is_not_read_where_every_layer_is_sparse(variant, tmp_path):
    """intermediate_size is the dense layers' MLP width: with every layer MoE transformers builds
    no dense MLP and never reads it (a 0, a negative, the key left out), where moefold refused the
    checkpoint ('intermediate_size=0 must be > 0', 'config.json has no intermediate_size')."""
    _assert_imports_as_transformers_builds(UNUSED_DENSE_WIDTH[variant], tmp_path / "hf")


@pytest.mark.parametrize("variant", UNUSED_EXPERT_SIZES)
def test_the_expert_sizes_are_not_read_where_every_layer_is_dense(variant, tmp_path):
    """Likewise moe_intermediate_size and num_experts_per_tok with no MoE layer (num_experts 0, every
    layer in mlp_only_layers, first_k_dense_replace past the last): moefold refused the checkpoint
    ('moe_intermediate_size=0 must be > 0', 'config.json has no num_experts_per_tok')."""
    _assert_imports_as_transformers_builds(UNUSED_EXPERT_SIZES[variant], tmp_path / "hf")


@pytest.mark.parametrize("config", [{**QWEN, "intermediate_size": 0, "decoder_sparse_step": 2},
                                    {**QWEN, "intermediate_size": 0, "mlp_only_layers": [3]},
                                    {**DEEPSEEK, "intermediate_size": 0}])
def test_a_dense_mlp_width_of_0_where_a_layer_is_dense_is_refused_by_its_key(config):
    """transformers builds that layer's MLP of width 0 (it adds nothing): refused, as before."""
    with pytest.raises(CheckpointError, match=re.escape("config.json: intermediate_size=0 must be > 0")):
        config_from_hf(config)


# ---------------------------------------------------------------------------------------------
# YaRN without a factor or without the lengths: transformers' config class fills them in
# ---------------------------------------------------------------------------------------------

YARN_LENGTHS = {
    # factor = the config class's max_position_embeddings (32768, 131072, 4096) / 8
    "null_factor_no_max_position_embeddings": {"rope_type": "yarn", "factor": None,
                                               "original_max_position_embeddings": 8},
    # original_max_position_embeddings = the class's max_position_embeddings
    "no_lengths": {"rope_type": "yarn", "factor": 4.0},
    # both: factor = max / max = 1
    "null_factor_no_lengths": {"rope_type": "yarn", "factor": None},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("yarn", YARN_LENGTHS)
def test_yarn_without_max_position_embeddings_takes_the_config_classs_default(family, yarn, tmp_path):
    """transformers derives a null factor as max_position_embeddings / original_max_position_embeddings
    and defaults the original length to max_position_embeddings, where a config.json without that key
    has its config class's default; moefold took 0 there and refused the checkpoint ('model.rope_factor=0.0
    must be >= 1', 'model.rope_original_max_len=0 must be > 0')."""
    config = {k: v for k, v in FAMILIES[family].items() if k != "max_position_embeddings"}
    _assert_imports_as_transformers_builds({**config, "rope_parameters": YARN_LENGTHS[yarn]}, tmp_path / "hf")


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("lengths", [{}, {"max_position_embeddings": 32},
                                     {"max_position_embeddings": 32, "original_max_position_embeddings": 8}])
def test_yarn_without_a_factor_key_is_refused_as_transformers_refuses_it(key, lengths, tmp_path):
    """transformers' YaRN validation requires the factor key ('Missing required keys in
    `rope_parameters` for 'rope_type'='yarn': {'factor'}'); moefold derived one from the lengths
    where they were given (32 / 8 = 4), a model transformers cannot load."""
    config = {**QWEN, **lengths, key: {"rope_type": "yarn", "original_max_position_embeddings": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match="factor"):
        transformers.AutoConfig.from_pretrained(tmp_path)
    message = (f"config.json: {key} is yarn without a factor (transformers requires the key); give {key}.factor, "
               "or null for max_position_embeddings / original_max_position_embeddings")
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == message


@pytest.mark.parametrize("max_len", [0, -4])
def test_yarn_of_a_null_factor_refuses_a_max_position_embeddings_below_1_by_its_key(max_len):
    """transformers divides by it (0 / 0 there); moefold's derivation would too."""
    config = {**QWEN, "max_position_embeddings": max_len, "rope_parameters": {"rope_type": "yarn", "factor": None}}
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == f"config.json: max_position_embeddings={max_len} must be > 0"


# ---------------------------------------------------------------------------------------------
# The loss of fp64 logits: in fp64
# ---------------------------------------------------------------------------------------------


def _fp64_head_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h_BSD = torch.randn(2, 13, 16, dtype=torch.float64, generator=gen)
    w_VD = torch.randn(50, 16, dtype=torch.float64, generator=gen)
    labels_BS = torch.randint(0, 50, (2, 13), generator=gen)
    labels_BS[0, :3] = IGNORE_INDEX
    return h_BSD, w_VD, labels_BS


def _fp64_reference(h_BSD, w_VD, labels_BS):
    h, w = h_BSD.clone().requires_grad_(), w_VD.clone().requires_grad_()
    loss = F.cross_entropy((h @ w.T).flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), h.grad, w.grad


_FP64 = dict(rtol=1e-12, atol=1e-14)  # fp32's rounding (~1e-7) fails it


@pytest.mark.parametrize("step", [chunk_loss_and_grad, fused_chunk_loss_and_grad])
@pytest.mark.parametrize("chunk", [5, 100])  # several chunks, the last short; one
def test_the_chunked_loss_of_fp64_inputs_is_fp64_cross_entropy(step, chunk):
    """An fp64 model's chunked loss took its logits, loss and gradients through fp32 (loss 1e-7
    off, in fp32): it computes in the inputs' dtype where that is wider than fp32."""
    h_BSD, w_VD, labels_BS = _fp64_head_inputs()
    expected, grad_h, grad_w = _fp64_reference(h_BSD, w_VD, labels_BS)
    h, w = h_BSD.clone().requires_grad_(), w_VD.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, labels_BS, chunk, step)
    loss.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, **_FP64)
    torch.testing.assert_close(h.grad, grad_h, **_FP64)
    torch.testing.assert_close(w.grad, grad_w, **_FP64)
    with torch.no_grad():  # validation's loss-only path
        torch.testing.assert_close(chunked_linear_cross_entropy(h_BSD, w_VD, labels_BS, chunk, step), expected, **_FP64)


def test_the_plain_loss_of_fp64_logits_is_fp64_cross_entropy():
    """cross_entropy_loss cast fp64 logits down to fp32 ('.float()'); it widens bf16/fp16 only."""
    h_BSD, w_VD, labels_BS = _fp64_head_inputs()
    expected, _, _ = _fp64_reference(h_BSD, w_VD, labels_BS)
    loss = cross_entropy_loss(h_BSD @ w_VD.T, labels_BS)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, **_FP64)


def test_deepseek_yarn_of_a_null_factor_with_mscale_all_dim_is_refused_as_transformers_fails_on_it(tmp_path):
    """DeepseekV3Attention scales its softmax by yarn_get_mscale(factor, mscale_all_dim) with the
    factor as written (None <= 1: a TypeError there, as in DeepSeek's own modeling code); moefold
    built a model from the factor it derived for the rotary embedding alone."""
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8, "mscale": 0.707,
            "mscale_all_dim": 1.0}
    config = {**DEEPSEEK, "max_position_embeddings": 32, "rope_parameters": yarn}
    with pytest.raises(TypeError):
        _transformers_of(config, tmp_path / "hf")
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == ("config.json: rope_parameters.factor=null is not supported beside "
                            "rope_parameters.mscale_all_dim=1.0: DeepSeek-V3's attention scales by the factor "
                            "as written; give rope_parameters.factor")
    # without mscale_all_dim only the rotary embedding reads it, derived: transformers builds it
    _assert_imports_as_transformers_builds({**config, "rope_parameters": {**yarn, "mscale_all_dim": 0}},
                                           tmp_path / "hf2")


@pytest.mark.parametrize("lengths, yarn, message", [
    ({"max_position_embeddings": 32}, {"factor": 0.5}, "rope_parameters.factor=0.5 must be >= 1"),
    ({"max_position_embeddings": 4}, {"factor": None},
     "rope_parameters.factor=null is max_position_embeddings / original_max_position_embeddings = 4 / 8 = 0.5, "
     "which must be >= 1"),
])
def test_a_yarn_factor_below_1_is_refused_by_its_keys(lengths, yarn, message):
    """moefold's YaRN extends the context only (transformers warns and compresses); the refusal
    named moefold's field ('config.json maps to an invalid moefold config: model.rope_factor=0.5 ...')."""
    config = {**QWEN, **lengths, "rope_parameters": {**_YARN, **yarn}}
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == f"config.json: {message}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_an_export_of_a_config_json_without_max_position_embeddings_states_transformers_default(family, rope,
                                                                                                tmp_path):
    """transformers builds the model of such a config.json with its config class's context length
    (Qwen3-MoE 32768, Mixtral 131072, DeepSeek-V3 4096); moefold's export stated max(train.seq_len,
    4096), or original · factor (32) under YaRN, a different context for serving engines to size for."""
    config = {k: v for k, v in FAMILIES[family].items() if k != "max_position_embeddings"}
    if rope:
        config["rope_parameters"] = rope
    _transformers_of(config, tmp_path / "hf")
    expected = transformers.AutoConfig.from_pretrained(tmp_path / "hf").max_position_embeddings
    save_pretrained(load_pretrained(tmp_path / "hf"), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == expected


# ---------------------------------------------------------------------------------------------
# A config class's field beside its alias: transformers sets the alias after the field
# ---------------------------------------------------------------------------------------------

ALIASED_EXPERTS = {  # the alias's 6 experts win, whichever comes first in the file
    "qwen3_moe-num_local_experts": ({**QWEN, "num_experts": 4, "num_local_experts": 6}, 6),
    "qwen3_moe-num_local_experts_first": ({"num_local_experts": 6, **QWEN, "num_experts": 4}, 6),
    "mixtral-num_experts": ({**MIXTRAL, "num_local_experts": 4, "num_experts": 6}, 6),
    "mixtral-num_experts_alone": ({**{k: v for k, v in MIXTRAL.items() if k != "num_local_experts"},
                                   "num_experts": 6}, 6),
    "deepseek_v3-num_local_experts": ({**DEEPSEEK, "n_routed_experts": 8, "num_local_experts": 4}, 4),
    "deepseek_v3-num_local_experts_alone": ({**{k: v for k, v in DEEPSEEK.items() if k != "n_routed_experts"},
                                             "num_local_experts": 4}, 4),
}


@pytest.mark.parametrize("variant", ALIASED_EXPERTS)
def test_an_expert_count_under_both_names_is_read_as_transformers_reads_it(variant, tmp_path):
    """Qwen3MoeConfig's num_experts, MixtralConfig's num_local_experts and DeepseekV3Config's
    n_routed_experts each have an alias (attribute_map) that config.json may hold too; transformers
    sets it after the field, so it wins. moefold took the field (a model of other expert count,
    refused for its tensors: '12 tensor(s) with no place in the model'), and refused a Mixtral or
    DeepSeek-V3 config.json holding the alias alone ('config.json has no num_local_experts')."""
    config, experts = ALIASED_EXPERTS[variant]
    assert config_from_hf(config).moe.num_experts == experts
    _assert_imports_as_transformers_builds(config, tmp_path / "hf")
