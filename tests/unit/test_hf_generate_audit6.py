"""Hugging Face interop of `moefold convert` and `moefold generate`, against transformers: the
end-of-sequence ids a round trip keeps (config.json's and generation_config.json's), the ids
greedy generation stops at, and how a prompt is encoded."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_interop import SEQ, VOCAB, assert_rel_close, deepseek_v3, hf_model_of, mixtral, qwen3  # noqa: E402

from moefold.cli import main  # noqa: E402
from moefold.data.tokenizer import ByteTokenizer  # noqa: E402


def _json(path):
    return json.loads(path.read_text())


def _round_trip(hf, tmp_path):
    """convert --from-hf `hf`, then convert --to-hf: the export's directory."""
    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(back)]) == 0
    return back


# ---------------------------------------------------------------------------------------------
# 1. eos_token_id survives convert --from-hf then --to-hf
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [2, [2, 7]])
def test_a_mixtral_converted_without_tokenizer_json_keeps_its_eos_token_id(eos, tmp_path):
    """A Mixtral checkpoint without tokenizer.json converted to a run and exported back said
    eos_token_id null: transformers' generate on the export never stopped where the original did."""
    hf = tmp_path / "hf"
    hf_model_of(mixtral(eos_token_id=eos)).save_pretrained(hf)
    back = _round_trip(hf, tmp_path)
    assert _json(back / "config.json")["eos_token_id"] == eos
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert model.generation_config.eos_token_id == eos


def test_a_mixtral_config_json_without_eos_token_id_keeps_the_config_classs(tmp_path):
    """transformers builds a config.json without the key with MixtralConfig's eos_token_id, 2."""
    hf = tmp_path / "hf"
    hf_model_of(mixtral()).save_pretrained(hf)
    config = _json(hf / "config.json")
    del config["eos_token_id"]
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "generation_config.json").unlink()
    assert transformers.AutoConfig.from_pretrained(hf).eos_token_id == 2
    assert _json(_round_trip(hf, tmp_path) / "config.json")["eos_token_id"] == 2


def test_generation_config_jsons_eos_token_ids_survive_a_round_trip(tmp_path):
    """Qwen3 instruct: config.json says <|im_end|>, generation_config.json <|im_end|> and
    <|endoftext|>; transformers' generate stops at both, before and after the round trip."""
    hf = tmp_path / "hf"
    reference = hf_model_of(qwen3(eos_token_id=9))
    reference.generation_config.eos_token_id = [9, 4]
    reference.save_pretrained(hf)
    back = _round_trip(hf, tmp_path)
    assert _json(back / "config.json")["eos_token_id"] == 9
    assert _json(back / "generation_config.json")["eos_token_id"] == [9, 4]
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert model.generation_config.eos_token_id == [9, 4]


def test_train_init_from_hf_keeps_both_files_eos_token_ids(tmp_path, text_corpus):
    """A run started from a checkpoint (train --init-from-hf) stops where the checkpoint's
    generate stops too: its config.toml keeps config.json's and generation_config.json's ids."""
    from conftest import TINY_OVERRIDES, cli_args

    from moefold.generate import run_config

    hf = tmp_path / "hf"
    reference = hf_model_of(qwen3(vocab_size=300, eos_token_id=9))
    reference.generation_config.eos_token_id = [9, 4]
    reference.save_pretrained(hf)
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(hf), "--run-dir", str(run), *cli_args(overrides)]) == 0
    m = run_config(run).model
    assert (m.eos_token_ids, m.generation_eos_token_ids) == ([9], [9, 4])


def test_a_null_eos_token_id_stays_null(tmp_path):
    hf = tmp_path / "hf"
    hf_model_of(qwen3()).save_pretrained(hf)
    back = _round_trip(hf, tmp_path)
    assert _json(back / "config.json")["eos_token_id"] is None
    assert "eos_token_id" not in _json(back / "generation_config.json")  # kept, as transformers saved it
    assert transformers.AutoModelForCausalLM.from_pretrained(back).generation_config.eos_token_id is None


@pytest.mark.parametrize("where, value, message", [
    ("config.json", "2", 'config.json: eos_token_id="2" is not a token id'),
    ("config.json", [2, 1.5], "config.json: eos_token_id=[2, 1.5] is not a token id"),
    ("generation_config.json", True, "generation_config.json: eos_token_id=true is not a token id"),
])
def test_an_eos_token_id_that_is_no_id_is_refused_by_its_file_and_key(where, value, message, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf_model_of(mixtral()).save_pretrained(hf)
    (hf / where).write_text(json.dumps({**_json(hf / where), "eos_token_id": value}))
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 2. generate stops at every id of generation_config.json's eos_token_id
# ---------------------------------------------------------------------------------------------


def _free_greedy(reference, prompt_ids, n):
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_generate_stops_at_every_eos_id_of_generation_config_as_transformers_does(tmp_path, capsys):
    """generation_config.json lists two eos ids (neither the byte tokenizer's 256): transformers'
    greedy generate stops at the first that comes; moefold generate ran on past it to 256."""
    reference = hf_model_of(qwen3(vocab_size=300))
    prompt = "moefold: é"
    prompt_ids = ByteTokenizer().encode(prompt)
    free = _free_greedy(reference, prompt_ids, 24)
    stop = next(j for j in range(3, 24) if free[j] not in free[:j] and free[j] < 256)
    reference.generation_config.eos_token_id = [299, free[stop]]  # 299: never reached first
    reference.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "24",
                 "--temperature", "0", "--device", "cpu"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():  # the directory's generation_config.json, nothing passed
        hf_ids = loaded.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert hf_ids == free[:stop + 1]  # transformers stopped at it (and emitted it)
    assert capsys.readouterr().out == ByteTokenizer().decode(prompt_ids + hf_ids[:-1]) + "\n"


def test_sample_stops_at_any_of_several_ids():
    from moefold.config import load_config
    from moefold.generate import sample
    from moefold.models.transformer import build_model

    model = build_model(load_config("tiny", {"model.vocab_size": str(VOCAB)}), VOCAB)
    model.init_weights(seed=0)
    free = sample(model, [1, 2, 3], 12, 0.0, 0, 64, -1, torch.Generator())
    stop = next(j for j in range(2, 12) if free[j] not in free[:j])
    assert sample(model, [1, 2, 3], 12, 0.0, 0, 64, [VOCAB - 1, free[stop]], torch.Generator()) == free[:stop]
    assert sample(model, [1, 2, 3], 12, 0.0, 0, 64, np.int64(free[stop]), torch.Generator()) == free[:stop]


# ---------------------------------------------------------------------------------------------
# 3. generate encodes a prompt as transformers' tokenizer(prompt) does (Llama's BOS, specials)
# ---------------------------------------------------------------------------------------------

_TEXTS = ["the model routes each token to its experts", "hello world, hello experts",
          "def main(): return 0", "a mixture of experts reads the prompt once"] * 20
_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _tokenizer_dir(path, style):
    """A small BPE tokenizer.json trained here and its tokenizer_config.json, as the Hub's:
    "llama": SentencePiece-style (Metaspace) whose post-processor adds <s> (Mixtral's,
    tokenizer_class LlamaTokenizer, add_bos_token); "qwen": byte-level without a BOS, with
    chat tokens (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if style == "llama" else None))
    if style == "llama":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        alphabet = []
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(_TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=_SPECIALS,
                                                              initial_alphabet=alphabet))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if style == "llama":
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                  "add_eos_token": False, "tokenizer_class": "LlamaTokenizer", "legacy": False}
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("style", ["llama", "qwen"])
@pytest.mark.parametrize("prompt", ["hello world", "the experts", "<|im_start|>hello<|im_end|> world"])
def test_a_prompt_encodes_as_transformers_tokenizer_encodes_it(style, prompt, tmp_path):
    """Prompts were encoded as training text: no BOS where the tokenizer adds one (Llama's,
    Mixtral's, DeepSeek's), and a chat token spelled in the prompt as plain text."""
    from moefold.data.tokenizer import HFTokenizer

    path = _tokenizer_dir(tmp_path / "tok", style)
    expected = transformers.AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    tokenizer = HFTokenizer(str(path / "tokenizer.json"))
    assert tokenizer.encode_prompt(prompt) == expected
    assert (expected[0] == 1) == (style == "llama")  # the BOS is there to compare


def test_training_text_still_encodes_without_special_tokens(tmp_path):
    """The corpus's ids do not move: no BOS, and a chat token spelled in a document is text."""
    from moefold.data.tokenizer import HFTokenizer

    path = _tokenizer_dir(tmp_path / "tok", "llama")
    tokenizer = HFTokenizer(str(path / "tokenizer.json"))
    text = "hello <|im_end|> world"
    ids = tokenizer.encode(text)
    assert [a.tolist() for a in tokenizer.encode_batch_np([text])] == [ids]
    assert 1 not in ids and 4 not in ids  # <s>, <|im_end|>
    assert tokenizer.encode_prompt(text)[:2] == [1, ids[0]]
    assert 4 in tokenizer.encode_prompt(text)


def test_generate_continues_a_bos_prompt_as_transformers_greedy_generate(tmp_path, capsys):
    """The whole command on a Mixtral whose tokenizer adds <s>: moefold generate read the prompt
    without it and continued otherwise than transformers' greedy generate of tokenizer(prompt)."""
    from moefold.data.tokenizer import HFTokenizer
    from moefold.generate import continuation

    hf = _tokenizer_dir(tmp_path / "hf", "llama")
    vocab = HFTokenizer(str(hf / "tokenizer.json")).vocab_size
    reference = hf_model_of(mixtral(vocab_size=vocab, eos_token_id=None, bos_token_id=1))
    reference.save_pretrained(hf)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    prompt = "hello world"
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "8",
                 "--temperature", "0", "--device", "cpu"]) == 0
    prompt_ids = transformers.AutoTokenizer.from_pretrained(hf)(prompt)["input_ids"]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)  # </s>: the run's end of document
    new_ids = out[0, len(prompt_ids):].tolist()
    new_ids = new_ids[:new_ids.index(2)] if 2 in new_ids else new_ids
    tokenizer = HFTokenizer(str(hf / "tokenizer.json"))
    with_bos = continuation(tokenizer, prompt, prompt_ids, new_ids)
    without = reference.generate(torch.tensor([prompt_ids[1:]]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(prompt_ids) - 1:].tolist()
    assert without != out[0, len(prompt_ids):].tolist()  # the BOS changes the continuation
    assert capsys.readouterr().out == with_bos + "\n"


# ---------------------------------------------------------------------------------------------
# 4. config.json values transformers reads otherwise: first_k_dense_replace < 0, nulls
# ---------------------------------------------------------------------------------------------


def _logits_match(hf_config, tmp_path):
    from moefold.checkpoint.hf import load_pretrained

    reference = hf_model_of(hf_config)
    reference.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_rel_close(ours(ids), reference(ids).logits, 1e-5, "logits")
    return ours


@pytest.mark.parametrize("first_k", [-1, -5])
def test_deepseek_first_k_dense_replace_below_0_is_no_dense_layer_as_in_transformers(first_k, tmp_path):
    """transformers' DeepseekV3DecoderLayer is MoE where layer_idx >= first_k_dense_replace: every
    layer for -1; moefold refused it ('moe.first_k_dense must be >= 0')."""
    ours = _logits_match(deepseek_v3(first_k_dense_replace=first_k), tmp_path)
    assert ours.cfg.moe.first_k_dense == 0 and len(list(ours.moe_layers())) == 2


# The keys whose null transformers 5's config classes refuse (a field typed without None), or whose
# model it cannot build from null (DeepSeek-V3's first_k_dense_replace: layer_idx >= None).
NON_NULL = {
    qwen3: ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "use_cache", "tie_word_embeddings", "attention_bias", "use_sliding_window", "attention_dropout",
            "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
            "output_router_logits", "router_aux_loss_coef"),
    mixtral: ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
              "use_cache", "tie_word_embeddings", "attention_dropout", "num_experts_per_tok", "num_local_experts",
              "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"),
    deepseek_v3: ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "n_shared_experts", "n_routed_experts", "output_router_logits",
                  "routed_scaling_factor", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "hidden_act",
                  "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache", "tie_word_embeddings",
                  "attention_bias", "num_mtp_layers", "first_k_dense_replace"),
}


def _transformers_builds(config: dict) -> bool:
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        hf_config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    except Exception:
        return False
    return True


@pytest.mark.parametrize("make, key", [(make, key) for make, keys in NON_NULL.items() for key in keys])
def test_a_null_transformers_cannot_build_from_is_refused_by_its_key(make, key):
    """A null was read as the config class's default (rms_norm_eps: null as 1e-6) where
    transformers refuses the config.json or fails to build its model."""
    from moefold.checkpoint.hf import config_from_hf
    from moefold.errors import CheckpointError

    config = {**make().to_dict(), key: None}
    assert not _transformers_builds(config)
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value).startswith(f"config.json: {key}=null ")


# ---------------------------------------------------------------------------------------------
# 4c. YaRN without rounding its correction range (rope_parameters.truncate=false, as gpt-oss)
# ---------------------------------------------------------------------------------------------

# head_dim 8: the correction range's ends, 0.10 and 1.01 dims, round to 0 and 2
_UNROUNDED_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 1.0}


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_inv_freq_equals_transformers_with_and_without_truncation(truncate):
    """rope_parameters.truncate=false was refused; now the correction range keeps its fractional
    ends and the inverse frequencies equal transformers' `_compute_yarn_parameters` bit for bit."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from moefold.checkpoint.hf import config_from_hf
    from moefold.models.rope import _yarn_inv_freq_half
    from moefold.models.transformer import rope_scaling

    hf_config = qwen3(rope_parameters={**_UNROUNDED_YARN, "truncate": truncate}, max_position_embeddings=256)
    expected, _ = _compute_yarn_parameters(hf_config)
    m = config_from_hf(hf_config.to_dict()).model
    ours = _yarn_inv_freq_half(m.head_dim, m.rope_theta, rope_scaling(m), None)
    assert torch.equal(ours, expected)
    rounded, _ = _compute_yarn_parameters(qwen3(rope_parameters=_UNROUNDED_YARN, max_position_embeddings=256))
    assert torch.equal(ours, rounded) == truncate  # the rounding shows


def test_unrounded_yarn_logits_match_transformers_and_survive_an_export(tmp_path):
    from moefold.checkpoint.hf import save_pretrained

    hf_config = qwen3(rope_parameters={**_UNROUNDED_YARN, "truncate": False}, max_position_embeddings=256)
    ours = _logits_match(hf_config, tmp_path)
    assert ours.cfg.model.yarn_truncate is False
    save_pretrained(ours, tmp_path / "back")
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert reloaded.rope_parameters["truncate"] is False


def test_yarn_truncate_without_yarn_is_refused_as_inert():
    from moefold.config import load_config
    from moefold.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.yarn_truncate=False needs model.rope_scaling='yarn'"):
        load_config("tiny", {"model.yarn_truncate": "false"})
    cfg = load_config("tiny", {"model.rope_scaling": "yarn", "model.yarn_truncate": "false"})
    assert cfg.model.yarn_truncate is False
