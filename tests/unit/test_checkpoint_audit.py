"""Checkpoints and Hugging Face interop, audited against independent references: transformers'
models built from the same directory (logits), transformers' own config defaults, and what a run
was saved with (a resume or an export that would silently change the model is refused by name)."""

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import TINY_OVERRIDES, cli_args  # noqa: E402
from test_hf_interop import (  # noqa: E402
    VOCAB, assert_rel_close, deepseek_v3, hf_load, hf_model_of, mixtral, qwen3, randomize_ours)

from moefold.checkpoint.hf import INDEX, load_pretrained, save_pretrained  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.config import load_config  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402
from moefold.models.transformer import build_model  # noqa: E402

SEQ = 20  # past the sliding windows and YaRN's original lengths below


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Import: the logits transformers computes from the same directory
# ---------------------------------------------------------------------------------------------


def _yarn(**kw) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8, **kw}


IMPORTED = {
    "qwen3_moe-head_dim_wider_than_dim_over_heads": lambda: qwen3(head_dim=16),
    "qwen3_moe-yarn": lambda: qwen3(rope_parameters=_yarn(), max_position_embeddings=32),
    "qwen3_moe-yarn-mscale_ratio": lambda: qwen3(rope_parameters=_yarn(mscale=0.707, mscale_all_dim=1.0),
                                                 max_position_embeddings=32),
    "qwen3_moe-top_k_all_experts": lambda: qwen3(num_experts_per_tok=6),
    "qwen3_moe-sparse_step_3": lambda: qwen3(num_hidden_layers=4, decoder_sparse_step=3),
    "qwen3_moe-dense": lambda: qwen3(num_experts=0),  # transformers builds every layer dense: Llama-like
    "qwen3_moe-only_mlp_layers": lambda: qwen3(mlp_only_layers=[0, 1, 2]),
    "mixtral-head_dim": lambda: mixtral(head_dim=16),
    "mixtral-yarn": lambda: mixtral(head_dim=8, rope_parameters=_yarn(), max_position_embeddings=32),
    "mixtral-tied": lambda: mixtral(tie_word_embeddings=True),
    "deepseek_v3-tied": lambda: deepseek_v3(tie_word_embeddings=True),
    "deepseek_v3-no_dense_layer": lambda: deepseek_v3(first_k_dense_replace=0),
    "deepseek_v3-all_dense": lambda: deepseek_v3(first_k_dense_replace=2),
    "deepseek_v3-two_shared_experts": lambda: deepseek_v3(n_shared_experts=2),
    "deepseek_v3-no_nope_dims": lambda: deepseek_v3(qk_nope_head_dim=0),
    "deepseek_v3-yarn-mscale_ratio": lambda: deepseek_v3(rope_parameters=_yarn(mscale=0.707, mscale_all_dim=1.0),
                                                         max_position_embeddings=32),
    "deepseek_v3-yarn-no_softmax_mscale": lambda: deepseek_v3(rope_parameters=_yarn(mscale=1.0, mscale_all_dim=0.0),
                                                              max_position_embeddings=32),
    "deepseek_v3-yarn-rotate_half": lambda: deepseek_v3(rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0),
                                                        max_position_embeddings=32, rope_interleave=False,
                                                        q_lora_rank=12),
}


@pytest.mark.parametrize("variant", IMPORTED)
def test_an_imported_checkpoint_computes_transformers_logits_and_exports_back_the_same(variant, tmp_path):
    """Configs test_hf_interop's variants leave out (head_dim not dim / heads, YaRN on the GQA
    families and its mscale forms on MLA, tied heads, no or only dense layers, a dense Qwen3-MoE
    (num_experts=0), ...): moefold's logits are transformers' from the same directory, and
    transformers reloads moefold's export with its own logits, bit for bit."""
    hf = hf_model_of(IMPORTED[variant](), seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(_ids()).logits
        assert_rel_close(ours(_ids()), expected, 1e-5, "logits")
    save_pretrained(ours, tmp_path / "ours")
    reloaded, info = hf_load(tmp_path / "ours")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, expected)


# The smallest config.json of each family: every key transformers' config class defaults left out.
MINIMAL = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=8, head_dim=4, moe_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=16, head_dim=4, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=16, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=12,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}


@pytest.mark.parametrize("family", MINIMAL)
def test_keys_config_json_leaves_out_take_transformers_defaults(family, tmp_path):
    """A config.json without the keys its config class defaults (rope_theta, rms_norm_eps, the
    router's norm_topk_prob / n_group / topk_group / routed_scaling_factor, first_k_dense_replace,
    the kv heads, ...) builds the model transformers builds from it."""
    minimal = MINIMAL[family]
    (tmp_path / "config.json").write_text(json.dumps(minimal))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = hf_model_of(hf_config, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(minimal))  # the keys transformers wrote, gone
    ours = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert_rel_close(ours(_ids()), hf(_ids()).logits, 1e-5, "logits")


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: one line naming the file and tensor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, ["model-00001-of-00002.safetensors"], None])
def test_an_index_mapping_a_tensor_to_no_file_name_is_a_one_line_error(value, tmp_path, capsys):
    """A weight_map value that is not a file name (a number, a list, null: a hand-edited or
    generated index) ended in a TypeError traceback while the shards were listed."""
    path = tmp_path / "hf"
    hf_model_of(qwen3()).save_pretrained(path, max_shard_size="20KB")
    index = json.loads((path / INDEX).read_text())
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    index["weight_map"][name] = value
    (path / INDEX).write_text(json.dumps(index))
    capsys.readouterr()  # transformers' progress bar
    message = f"weight_map maps {name} to {json.dumps(value)}, not a file name"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path / INDEX}: weight_map maps {name} to" in err[0], err

    assert not run.exists()


# ---------------------------------------------------------------------------------------------
# Export: what transformers would run differently is refused by name
# ---------------------------------------------------------------------------------------------


def test_an_export_of_a_model_that_routes_round_robin_is_refused(tmp_path, tiny_args, capsys):
    """moe.force_balanced (benchmarks) sends tokens to experts by their place, not by the router:
    transformers routes the export by its router, which the run never used, and computes other
    logits, silently (as `generate` refuses to sample such a model)."""
    cfg = load_config("tiny-qwen3", {"model.vocab_size": str(VOCAB), "moe.force_balanced": "true"})
    model = build_model(cfg, VOCAB)
    randomize_ours(model, seed=5)
    with pytest.raises(CheckpointError, match=r"^moe.force_balanced=True cannot be saved as a qwen3_moe checkpoint"):
        save_pretrained(model.eval(), tmp_path / "direct")
    assert not (tmp_path / "direct").exists()

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "1", "--train.warmup_steps", "0",
                 "--moe.force_balanced", "true"]) == 0
    capsys.readouterr()
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe.force_balanced=True cannot be saved" in err[0], err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------
# Resume with changed options
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("saved", ["converted (weights only)", "trained (full)"])
def test_a_resume_that_ties_the_embeddings_of_an_untied_run_is_refused(saved, tmp_path, text_corpus, capsys):
    """A checkpoint holds tok_embeddings.weight and output.weight, tied or not; a model that ties
    them loads both into its one tensor. Resuming a converted (weights-only) run with
    --model.tie_embeddings true trained on with the old output head as its embedding, silently."""
    run = tmp_path / "run"
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    if saved.startswith("converted"):
        hf_model_of(qwen3(vocab_size=300), seed=2).save_pretrained(tmp_path / "hf")
        assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    else:
        assert main(["train", "--run-dir", str(run), *cli_args(overrides)]) == 0
    overrides["train.steps"] = "2"
    capsys.readouterr()
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    assert main(["train", "--resume", str(run), *cli_args(overrides), "--model.tie_embeddings", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moefold: error: model.tie_embeddings=True, but {checkpoint} was saved by a run with "
                   "model.tie_embeddings=False, which holds the embedding and the output head apart: "
                   "a run continues with the model.* and moe.* it was trained with"], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [checkpoint.name]


def _losses(run: Path) -> dict[tuple[int, str], float]:
    """Every loss a run logged ("loss", "val_loss", "mtp_loss", ...) by (step, name)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], key): r[key] for r in records for key in r if "loss" in key}


@pytest.mark.parametrize("preset, extra", [
    ("tiny-deepseek", []),  # MLA with YaRN, grouped sigmoid routing with expert bias, an MTP module
    ("tiny-mixtral", ["--moe.input_jitter", "0.05", "--train.grad_accum", "2"]),  # router noise from the RNG
])
def test_a_resume_continues_the_uninterrupted_run_bit_for_bit(preset, extra, tmp_path, text_corpus):
    """Saved at step 2 of 4 and resumed in another run directory: every later training, MTP and
    validation loss equals the uninterrupted run's exactly (test_train's cover the tiny Qwen3 model)."""
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "4", "train.val_every": "2",
                      "train.val_batches": "1", "train.micro_batch_size": "2"})
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main(["train", "--config", preset, "--run-dir", str(full), *cli_args(overrides), *extra,
                 "--checkpoint.every", "2", "--checkpoint.keep", "2"]) == 0
    assert main(["train", "--resume", str(full / "checkpoints" / "step_00000002"), "--run-dir", str(resumed)]) == 0
    expected, got = _losses(full), _losses(resumed)
    assert {step for step, _ in got} == {3, 4} and {name for _, name in got} >= {"loss", "val_loss"}
    assert got == {key: expected[key] for key in got}


# ---------------------------------------------------------------------------------------------
# Round trips: Hugging Face → moefold → Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["qwen3_moe-40960", "mixtral-32768", "deepseek_v3-yarn"])
def test_an_export_of_an_import_states_the_config_values_it_was_given(variant, tmp_path, text_corpus):
    """Every key an export writes that the original config.json holds has its value there:
    max_position_embeddings, the context length serving engines size for (vLLM's max_model_len),
    was max(train.seq_len, 4096), 4096 for Qwen3-30B-A3B's 40960 and Mixtral's 32768. Through
    load_pretrained / save_pretrained and through convert --from-hf / --to-hf (the run's
    config.toml carries it). bos/eos ids are the run's (hf_config_from), not compared; a null in
    the original is a value transformers derives (Mixtral's head_dim), written explicitly."""
    hf_config = {"qwen3_moe-40960": lambda: qwen3(max_position_embeddings=40960),
                 "mixtral-32768": lambda: mixtral(max_position_embeddings=32768, vocab_size=300),
                 "deepseek_v3-yarn": lambda: deepseek_v3(rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0),
                                                         max_position_embeddings=32)}[variant]()
    hf_model_of(hf_config, seed=6).save_pretrained(tmp_path / "hf")
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    save_pretrained(load_pretrained(tmp_path / "hf"), tmp_path / "direct")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "cli")]) == 0
    for export in ("direct", "cli"):
        written = json.loads((tmp_path / export / "config.json").read_text())
        changed = {key: (original[key], value) for key, value in written.items()  # null: transformers derives it
                   if original.get(key) not in (None, value) and key not in ("bos_token_id", "eos_token_id")}
        assert not changed, (export, changed)


@pytest.mark.parametrize("tied", [False, True])
def test_init_from_hf_names_an_override_that_ties_or_unties_the_head(tied, tmp_path, text_corpus, capsys):
    """--model.tie_embeddings against the checkpoint's tie_word_embeddings keeps every shape, so it
    passed the override check and was blamed on the checkpoint once the model was allocated:
    'lm_head.weight must equal model.embed_tokens.weight ... but differs', or 'tensors the model
    needs are missing: lm_head.weight'. It is refused before, naming the option."""
    hf_model_of(qwen3(vocab_size=300, tie_word_embeddings=tied), seed=1).save_pretrained(tmp_path / "hf")
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    capsys.readouterr()
    assert main(["train", "--init-from-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"),
                 *cli_args(overrides), "--model.tie_embeddings", str(not tied).lower()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moefold: error: --init-from-hf {tmp_path / 'hf'}: model.tie_embeddings={not tied}, its "
                   f"config.json tie_word_embeddings={str(tied).lower()}; override only what keeps the "
                   "checkpoint's tensors"], err
    assert not (tmp_path / "run").exists()
