"""Dtypes through Hugging Face import and export: `moefold convert --dtype`, against what transformers
itself writes and computes.

The reference for an export in dtype X is transformers' own: the original checkpoint loaded with
`from_pretrained(dtype=X)` and written by its `save_pretrained` (it keeps DeepSeek-V3's router
weight and `e_score_correction_bias` in fp32 whatever X, its `_keep_in_fp32_modules_strict`).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moefold.checkpoint.hf import load_pretrained, save_pretrained  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402
from test_hf_interop import randomize  # noqa: E402

VOCAB = 300  # the run's byte tokenizer needs 257 ids
transformers.logging.set_verbosity_error()
_YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.7}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _qwen3(**kw):
    return transformers.Qwen3MoeConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
               num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
               rope_parameters={"rope_type": "default", "rope_theta": 123456.0}, initializer_range=0.05,
               max_position_embeddings=777, router_aux_loss_coef=0.02, use_sliding_window=True,
               sliding_window=5, norm_topk_prob=True, tie_word_embeddings=True, rms_norm_eps=1e-5), **kw})


def _mixtral(**kw):
    return transformers.MixtralConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
               num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 4321.0},
               initializer_range=0.03, max_position_embeddings=333, router_aux_loss_coef=0.05,
               router_jitter_noise=0.1, sliding_window=7, rms_norm_eps=1e-6), **kw})


def _deepseek_v3(**kw):
    return transformers.DeepseekV3Config(**{
        **dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
               kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               routed_scaling_factor=1.5, norm_topk_prob=False, num_nextn_predict_layers=0,
               rope_parameters=dict(_YARN), max_position_embeddings=256, initializer_range=0.04,
               aux_loss_alpha=0.003, seq_aux=False, rms_norm_eps=1e-5), **kw})


FAMILIES = {"qwen3_moe": _qwen3, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3}


def _bf16_checkpoint(path, family, seed=0):
    """A bf16 checkpoint as a Hub release is: every tensor bf16, DeepSeek-V3's
    `e_score_correction_bias` and router weight too (transformers would write those in fp32)."""
    hf_config = FAMILIES[family]()
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(path)
    tensors = safetensors_torch.load_file(path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    return path


def _convert_both_ways(tmp_path, hf_dir, *export_args):
    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(back), *export_args]) == 0
    return run, back


def _transformers_export(hf_dir, out, dtype):
    """What transformers writes for `hf_dir` loaded in `dtype`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.save_pretrained(out)
    return safetensors_torch.load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# convert --dtype: the tensors transformers writes, and a config.json that says their dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", [None, "fp32", "bf16", "fp16"])
def test_export_dtype_writes_what_transformers_writes(tmp_path, option):
    """bf16 DeepSeek-V3 → run → export: every tensor in the dtype transformers' own save of the
    checkpoint loaded in that dtype has (router weight and e_score_correction_bias fp32), with its
    values; config.json's torch_dtype is that dtype. Default: fp32, lossless."""
    hf_dir = _bf16_checkpoint(tmp_path / "hf", "deepseek_v3")
    _, back = _convert_both_ways(tmp_path, hf_dir, *(["--dtype", option] if option else []))
    dtype = _DTYPES[option or "fp32"]
    expected, expected_config = _transformers_export(hf_dir, tmp_path / "ref", dtype)
    written = safetensors_torch.load_file(back / "model.safetensors")
    assert written.keys() == expected.keys()
    for name, t in expected.items():
        assert written[name].dtype == t.dtype, name
        assert torch.equal(written[name], t), name
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    config = json.loads((back / "config.json").read_text())
    assert config["torch_dtype"] == expected_config["dtype"] == str(dtype).removeprefix("torch.")


def _fp32_checkpoint(path, family, seed):
    hf_config = FAMILIES[family]()
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path)
    return path


def _transformers_logits(path, dtype, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    assert model.model.embed_tokens.weight.dtype == (torch.bfloat16 if dtype == "auto" else dtype)
    with torch.no_grad():
        return model.eval()(ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_export_runs_in_transformers_as_the_checkpoint_does(tmp_path, family):
    """fp32 checkpoint → run → `--dtype bf16`: transformers, in the dtype config.json states
    ("auto"), computes the logits it computes from the fp32 checkpoint loaded in bf16, to the bit
    (DeepSeek-V3's router in fp32 from fp32 weights, not bf16-rounded ones); moefold's model and
    transformers agree on the exported weights; both are within bf16 rounding of moefold's fp32 model."""
    hf_dir = _fp32_checkpoint(tmp_path / "hf", family, seed=1)
    _, back = _convert_both_ways(tmp_path, hf_dir, "--dtype", "bf16")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    exported = _transformers_logits(back, "auto", ids)
    assert torch.equal(exported, _transformers_logits(hf_dir, torch.bfloat16, ids))
    with torch.no_grad():
        ours, ours_of_export = load_pretrained(hf_dir)(ids), load_pretrained(back)(ids)
    scale = ours.abs().max().item()
    err = (ours_of_export - _transformers_logits(back, torch.float32, ids)).abs().max().item()
    assert err <= 1e-5 * scale, err
    # bf16 compute can flip a routing decision (Mixtral's tiny router): a bound on the mean, not the max
    assert (exported - ours).abs().mean().item() <= 0.02 * scale


def test_a_bad_export_dtype_is_one_line_exit_2(tmp_path, capsys):
    hf_dir = _bf16_checkpoint(tmp_path / "hf", "mixtral")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "x"), "--dtype", "float8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--dtype" in err and all(v in err for v in ("fp32", "bf16", "fp16")), err
    assert not (tmp_path / "x").exists()
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "r2"), "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--dtype" in err and "--to-hf" in err, err
    assert not (tmp_path / "r2").exists()


def test_save_pretrained_refuses_a_dtype_transformers_cannot_load(tmp_path):
    model = load_pretrained(_bf16_checkpoint(tmp_path / "hf", "mixtral"))
    with pytest.raises(CheckpointError, match="float8_e4m3fn.*float32, bfloat16, float16"):
        save_pretrained(model, tmp_path / "out", dtype=torch.float8_e4m3fn)
    assert not (tmp_path / "out").exists()


def test_fp16_export_refuses_weights_beyond_its_range(tmp_path, capsys):
    """fp16's largest value is 65504: a weight above it would be written as inf."""
    model = load_pretrained(_bf16_checkpoint(tmp_path / "hf", "mixtral"))
    with torch.no_grad():
        model.layers[0].attn.wq.weight[1, 2] = 1e5
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj.weight .*float16"):
        save_pretrained(model, tmp_path / "out", dtype=torch.float16)
    assert not (tmp_path / "out").exists()
    save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)  # in bf16's range


# ---------------------------------------------------------------------------------------------
# Round trip: every tensor and every config.json key moefold carries
# ---------------------------------------------------------------------------------------------

_NOT_CARRIED = {
    "_name_or_path", "transformers_version",
    "bos_token_id", "eos_token_id",  # the run's tokenizer's: moefold trains without a BOS (docs/architecture.md)
    "attention_bias",  # Mixtral's config class has no such key: null there, false from moefold
}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_round_trips_through_a_run(tmp_path, family):
    """bf16 checkpoint (non-default values in every key moefold reads) → run → `--dtype bf16`
    export: every tensor bit-identical (DeepSeek-V3's fp32 ones equal in value), and transformers
    reads the same config from both config.json files."""
    hf_dir = _bf16_checkpoint(tmp_path / "hf", family)
    _, back = _convert_both_ways(tmp_path, hf_dir, "--dtype", "bf16")
    original = safetensors_torch.load_file(hf_dir / "model.safetensors")
    written = safetensors_torch.load_file(back / "model.safetensors")
    assert written.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(written[name].to(t.dtype), t), name
        assert written[name].dtype == t.dtype or name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
    before = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    after = transformers.AutoConfig.from_pretrained(back).to_dict()
    for key in sorted((before.keys() | after.keys()) - _NOT_CARRIED):
        assert after.get(key) == before.get(key) or before.get(key) is None, key


def test_bf16_load_keeps_what_transformers_keeps_in_fp32(tmp_path):
    """load_pretrained(dtype=bf16) holds each tensor in the dtype, and with the values, transformers'
    from_pretrained(dtype=bf16) holds it in: DeepSeek-V3's router weight fp32 from an fp32
    checkpoint, not bf16-rounded (the router computes in fp32 in both)."""
    hf_dir = _fp32_checkpoint(tmp_path / "hf", "deepseek_v3", seed=3)
    ours = load_pretrained(hf_dir, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    theirs = hf.state_dict()
    for ours_name, hf_name in (("layers.1.ffn.router.weight", "model.layers.1.mlp.gate.weight"),
                               ("layers.1.ffn.router.expert_bias_E", "model.layers.1.mlp.gate.e_score_correction_bias"),
                               ("layers.1.attn.wo.weight", "model.layers.1.self_attn.o_proj.weight")):
        t = ours.state_dict()[ours_name]
        assert t.dtype == theirs[hf_name].dtype and torch.equal(t, theirs[hf_name]), ours_name
