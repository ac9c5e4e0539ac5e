"""Hugging Face interop audit 15, against transformers building the same config.json (tiny random
fp32 models; the tolerances of test_hf_interop).

DeepSeek-V3 with `n_shared_experts=0`: transformers builds its shared-experts MLP of width
moe_intermediate_size·0 = 0, which adds zeros, and its save_pretrained writes the three
zero-element tensors (`gate_proj`/`up_proj` [0, D], `down_proj` [D, 0]); without them its
from_pretrained reports them missing. moefold reads it as `moe.shared_experts = 0`, takes the
checkpoint with or without those tensors, and writes them on export.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_audit3 import _run_checkpoint_tensors  # noqa: E402
from test_hf_audit5 import DEEPSEEK, MIXTRAL, QWEN, _assert_imports_as_transformers_builds  # noqa: E402
from test_hf_generate_audit6 import _transformers_builds  # noqa: E402
from test_hf_interop import (  # noqa: E402
    SEQ, VOCAB, assert_rel_close, deepseek_v3, hf_load, hf_model_of, hub_named, randomize_ours)

from moefold.checkpoint.hf import (  # noqa: E402
    config_from_hf, convert_to_run_checkpoint, hf_config_from, load_pretrained, save_pretrained)
from moefold.config import load_config  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402
from moefold.models.transformer import build_model  # noqa: E402

D = 32  # deepseek_v3()'s hidden_size
SHARED = ("gate_proj", "up_proj", "down_proj")


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _shared_names(layer: int) -> list[str]:
    return [f"model.layers.{layer}.mlp.shared_experts.{p}.weight" for p in SHARED]


@pytest.fixture(scope="module")
def no_shared(tmp_path_factory):
    """transformers' DeepSeek-V3 without shared experts and its own save (layer 1 is MoE)."""
    hf = hf_model_of(deepseek_v3(n_shared_experts=0), seed=7)
    path = tmp_path_factory.mktemp("no_shared")
    hf.save_pretrained(path)
    return hf, path


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = edit(safetensors_torch.load_file(src / "model.safetensors"))
    safetensors_torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------------------------------------
# n_shared_experts = 0
# ---------------------------------------------------------------------------------------------


def test_transformers_writes_zero_element_shared_experts(no_shared):
    """What the import and export below follow: transformers' own save holds the shared MLP's
    tensors with no elements."""
    _, path = no_shared
    written = safetensors_torch.load_file(path / "model.safetensors")
    assert [tuple(written[n].shape) for n in _shared_names(1)] == [(0, D), (0, D), (D, 0)]
    assert not any(n.startswith("model.layers.0.mlp.shared") for n in written)  # the dense layer


def test_no_shared_experts_import_matches_transformers(no_shared):
    hf, path = no_shared
    ours = load_pretrained(path)
    assert ours.cfg.moe.shared_experts == 0
    with torch.no_grad():
        assert_rel_close(ours(_ids(1)), hf(_ids(1)).logits, 1e-5, "logits")


def test_no_shared_experts_import_without_the_empty_tensors(no_shared, tmp_path):
    """A checkpoint written by a tool that drops zero-element tensors: nothing is missing."""
    hf, path = no_shared
    dropped = _rewrite(path, tmp_path / "dropped",
                       lambda t: {n: v for n, v in t.items() if ".shared_experts." not in n})
    ours = load_pretrained(dropped)
    with torch.no_grad():
        assert_rel_close(ours(_ids(2)), hf(_ids(2)).logits, 1e-5, "logits")


def test_no_shared_experts_converts_to_a_run(no_shared, tmp_path):
    """`convert --from-hf`'s out-of-core path: the run's checkpoint is load_pretrained's state dict."""
    _, path = no_shared
    cfg, checkpoint = convert_to_run_checkpoint(path, tmp_path / "run")
    assert cfg.moe.shared_experts == 0
    ours, reference = _run_checkpoint_tensors(checkpoint), load_pretrained(path).state_dict()
    assert ours.keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(ours[name], t), name


def test_no_shared_experts_refuses_a_shared_tensor_with_elements(no_shared, tmp_path):
    """n_shared_experts=0 with shared-expert weights of width 16 is not the model config.json states."""
    _, path = no_shared
    name = _shared_names(1)[0]
    widened = _rewrite(path, tmp_path / "widened", lambda t: {**t, name: torch.ones(16, D)})
    with pytest.raises(CheckpointError, match=r"shared_experts\.gate_proj\.weight has shape \[16, 32\]"):
        load_pretrained(widened)


def test_no_shared_experts_exports_to_what_transformers_saves(no_shared, tmp_path):
    """moefold → export → transformers: no missing, unexpected or mismatched keys, the same tensors
    (the zero-element ones too) and the same logits."""
    hf, path = no_shared
    save_pretrained(load_pretrained(path), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["n_shared_experts"] == 0
    reloaded, info = hf_load(tmp_path)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    expected = hub_named(hf.state_dict(), "deepseek_v3")
    actual = hub_named(reloaded.state_dict(), "deepseek_v3")
    assert actual.keys() == expected.keys()
    for name, t in expected.items():
        assert actual[name].shape == t.shape and torch.equal(actual[name], t), name
    with torch.no_grad():
        assert torch.equal(reloaded(_ids(3)).logits, hf(_ids(3)).logits)


def test_no_shared_experts_bf16_export_writes_the_empty_tensors_in_bf16(no_shared, tmp_path):
    """As transformers' bf16 save holds them: in the parameters' dtype."""
    _, path = no_shared
    save_pretrained(load_pretrained(path), tmp_path, dtype=torch.bfloat16)
    written = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert all(written[n].dtype == torch.bfloat16 and written[n].numel() == 0 for n in _shared_names(1))
    _, info = hf_load(tmp_path)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_native_model_without_shared_experts_exports_and_comes_back(tmp_path):
    """A moefold DeepSeek-V3 without shared experts (and an MTP module, whose block is MoE) opens in
    transformers with moefold's logits and reloads into moefold tensor for tensor."""
    cfg = load_config("tiny-deepseek", {"model.vocab_size": str(VOCAB), "moe.shared_experts": "0"})
    ours = build_model(cfg, VOCAB)
    randomize_ours(ours, seed=8)
    save_pretrained(ours.eval(), tmp_path)
    written = safetensors_torch.load_file(tmp_path / "model.safetensors")
    L = cfg.model.n_layers
    for layer in (*range(cfg.moe.first_k_dense, L), L):  # the MoE layers and the MTP block
        assert [tuple(written[n].shape) for n in _shared_names(layer)] == [(0, 64), (0, 64), (64, 0)]
    hf, info = hf_load(tmp_path)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"])  # MTP only
    ids = torch.randint(0, VOCAB, (2, 2 * SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
    again = load_pretrained(tmp_path)
    assert again.cfg.moe.shared_experts == 0 and again.cfg.model.mtp_layers == 1
    assert again.state_dict().keys() == ours.state_dict().keys()
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_no_shared_experts_config_round_trips():
    hf = {**deepseek_v3(n_shared_experts=0).to_dict(), "model_type": "deepseek_v3"}
    cfg = config_from_hf(hf)
    assert cfg.moe.shared_experts == 0
    assert hf_config_from(cfg, VOCAB)["n_shared_experts"] == 0


def test_negative_shared_experts_stay_refused():
    """transformers builds nn.Linear of a negative width: it fails there; refused by its key here."""
    hf = {**deepseek_v3().to_dict(), "model_type": "deepseek_v3", "n_shared_experts": -1}
    with pytest.raises(CheckpointError, match=r"^config.json: n_shared_experts=-1 .*>= 0"):
        config_from_hf(hf)


# ---------------------------------------------------------------------------------------------
# Keys transformers' modeling never reads, and values it builds that were refused
# ---------------------------------------------------------------------------------------------

FAMILIES = {"qwen3_moe": QWEN, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK}


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_bias_is_read_as_transformers_reads_it(family, tmp_path):
    """No modeling of the three reads mlp_bias (their MLPs and experts have no bias): true builds
    the model of false there, and was refused here."""
    _assert_imports_as_transformers_builds({**FAMILIES[family], "mlp_bias": True}, tmp_path / "m")


def test_mixtral_attention_bias_is_read_as_transformers_reads_it(tmp_path):
    """Mixtral's attention has no bias whatever attention_bias says (MixtralConfig has no such key)."""
    _assert_imports_as_transformers_builds({**MIXTRAL, "attention_bias": True}, tmp_path / "m")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_attention_bias_stays_refused_where_transformers_builds_one(family):
    with pytest.raises(CheckpointError, match=r"^config.json: attention_bias=True is not supported"):
        config_from_hf({**FAMILIES[family], "attention_bias": True})


def test_deepseek_v3_without_moe_layers_takes_any_expert_count(tmp_path):
    """first_k_dense_replace >= num_hidden_layers: transformers builds no MoE layer and never reads
    n_routed_experts (0 builds); the export writes a count it builds alike."""
    config = {**DEEPSEEK, "n_routed_experts": 0, "first_k_dense_replace": 2}
    _assert_imports_as_transformers_builds(config, tmp_path / "m")
    ours = load_pretrained(tmp_path / "m")
    save_pretrained(ours, tmp_path / "out")
    hf, info = hf_load(tmp_path / "out")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        assert_rel_close(ours(_ids(4)), hf(_ids(4)).logits, 1e-5, "logits")


def test_deepseek_v3_zero_experts_with_moe_layers_stay_refused():
    with pytest.raises(CheckpointError, match=r"^config.json: n_routed_experts=0 must be > 0$"):
        config_from_hf({**DEEPSEEK, "n_routed_experts": 0})


@pytest.mark.parametrize("key", ["n_group", "topk_group", "v_head_dim"])
def test_deepseek_v3_nulls_its_modeling_cannot_use_are_refused_by_key(key):
    """DeepseekV3Config takes null for these; its model divides by, tops-k by or adds them and fails.
    They were read as the class default (n_group 8, topk_group 4) or as missing."""
    config = {**DEEPSEEK, key: None}
    assert not _transformers_builds(config)
    with pytest.raises(CheckpointError, match=rf"^config.json: {key}=null is not allowed"):
        config_from_hf(config)


# ---------------------------------------------------------------------------------------------
# A key left out: transformers builds with its config class's default
# ---------------------------------------------------------------------------------------------

_QWEN_DENSE_LAYER = {**QWEN, "mlp_only_layers": [1]}  # a dense layer reads intermediate_size
LEFT_OUT = {  # config, key left out (the class default, with the tiny sizes beside it)
    "qwen3_moe-vocab_size": (QWEN, "vocab_size"),  # 151936
    "qwen3_moe-num_hidden_layers": (QWEN, "num_hidden_layers"),  # 24
    "qwen3_moe-num_attention_heads": (QWEN, "num_attention_heads"),  # 32, head_dim 8 given
    "qwen3_moe-intermediate_size": (_QWEN_DENSE_LAYER, "intermediate_size"),  # 6144
    "qwen3_moe-num_experts": (QWEN, "num_experts"),  # 128
    "mixtral-intermediate_size": (MIXTRAL, "intermediate_size"),  # 14336
    "mixtral-num_local_experts": (MIXTRAL, "num_local_experts"),  # 8
    "mixtral-num_experts_per_tok": ({**MIXTRAL, "num_experts_per_tok": 3}, "num_experts_per_tok"),  # 2
    "deepseek_v3-hidden_size": (DEEPSEEK, "hidden_size"),  # 7168
    "deepseek_v3-n_routed_experts": (DEEPSEEK, "n_routed_experts"),  # 256
    "deepseek_v3-kv_lora_rank": (DEEPSEEK, "kv_lora_rank"),  # 512
    "deepseek_v3-qk_rope_head_dim": (DEEPSEEK, "qk_rope_head_dim"),  # 64
    "deepseek_v3-qk_nope_head_dim": (DEEPSEEK, "qk_nope_head_dim"),  # 128
    "deepseek_v3-v_head_dim": (DEEPSEEK, "v_head_dim"),  # 128
    "deepseek_v3-moe_intermediate_size": (DEEPSEEK, "moe_intermediate_size"),  # 2048
    "deepseek_v3-intermediate_size": (DEEPSEEK, "intermediate_size"),  # 18432
    "deepseek_v3-num_experts_per_tok": (DEEPSEEK, "num_experts_per_tok"),  # 8
}


@pytest.mark.parametrize("variant", LEFT_OUT)
def test_a_key_left_out_is_the_config_class_default(variant, tmp_path):
    """These keys were required ('config.json has no v_head_dim'); transformers builds the model of
    its config class's default, as moefold reads every other key left out."""
    config, key = LEFT_OUT[variant]
    _assert_imports_as_transformers_builds({k: v for k, v in config.items() if k != key}, tmp_path / "m")


def test_a_key_left_out_and_its_alias_given_is_the_alias(tmp_path):
    """The default fills a key only where none of its names is given (Qwen3-MoE's num_local_experts)."""
    config = {k: v for k, v in QWEN.items() if k != "num_experts"}
    _assert_imports_as_transformers_builds({**config, "num_local_experts": 6}, tmp_path / "m")
    assert load_pretrained(tmp_path / "m").cfg.moe.num_experts == 6


@pytest.mark.parametrize("family", FAMILIES)
def test_the_class_defaults_are_transformers_own(family):
    """Each default filled in is the value of transformers' config class itself (the models above
    check a part of them; the rest would build models too large for a unit test)."""
    from moefold.checkpoint.hf_families import FAMILIES as HF_FAMILIES

    theirs = transformers.CONFIG_MAPPING[family]()
    for key, value in HF_FAMILIES[family].class_defaults.items():
        assert getattr(theirs, key) == value, key
