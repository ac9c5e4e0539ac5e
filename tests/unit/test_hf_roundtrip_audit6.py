"""What a Hugging Face round trip (convert --from-hf, train --init-from-hf, convert --to-hf) keeps
of a checkpoint's special-token ids and generation_config.json, against transformers 5: where its
generate stops, what its loaded generation config holds, and what its DeepSeek-V3 builds."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_generate_audit6 import _json, _logits_match, _round_trip  # noqa: E402
from test_hf_interop import deepseek_v3, hf_model_of, mixtral, qwen3  # noqa: E402

from moefold.cli import main  # noqa: E402
from moefold.data.tokenizer import ByteTokenizer  # noqa: E402


def _greedy(model, prompt_ids, n, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt_ids):].tolist()


# ---------------------------------------------------------------------------------------------
# 1. A generation_config.json without eos_token_id: transformers' generate stops at nothing
# ---------------------------------------------------------------------------------------------


def _checkpoint_whose_generation_config_has_no_eos(tmp_path, prompt_ids, n):
    """A Qwen3 whose config.json's eos_token_id is a token its greedy generate emits (never the
    byte tokenizer's 256, where moefold's generate also stops), with a generation_config.json
    that states no eos_token_id; and that greedy continuation."""
    free = _greedy(hf_model_of(qwen3(vocab_size=300)), prompt_ids, n, eos_token_id=None)
    n = free.index(256) if 256 in free else n
    eos = next(t for j, t in enumerate(free[2:n], 2) if t not in free[:j])
    reference = hf_model_of(qwen3(vocab_size=300, eos_token_id=eos))
    reference.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return tmp_path / "hf", eos, free[:n]


def test_a_generation_config_without_eos_token_id_stops_nowhere_as_in_transformers(tmp_path, capsys):
    """transformers 5 loads generation_config.json as it is (GenerationConfig.from_pretrained):
    no eos_token_id there is none, config.json's is not read; moefold stopped at config.json's."""
    prompt = "moefold: é"
    prompt_ids = ByteTokenizer().encode(prompt)
    hf, eos, free = _checkpoint_whose_generation_config_has_no_eos(tmp_path, prompt_ids, 24)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    assert loaded.generation_config.eos_token_id is None
    hf_ids = _greedy(loaded, prompt_ids, len(free))
    assert hf_ids == free and eos in free[:-1]  # ran on past config.json's eos
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", str(len(free)),
                 "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == ByteTokenizer().decode(prompt_ids + hf_ids) + "\n"


def test_the_export_keeps_a_generation_config_without_eos_token_id(tmp_path):
    """The export wrote config.json's ids into generation_config.json: its generate then stopped."""
    hf, eos, _ = _checkpoint_whose_generation_config_has_no_eos(tmp_path, ByteTokenizer().encode("ab"), 8)
    back = _round_trip(hf, tmp_path)
    assert _json(back / "config.json")["eos_token_id"] == eos
    assert _json(back / "generation_config.json") == {"do_sample": False}
    assert transformers.AutoModelForCausalLM.from_pretrained(back).generation_config.eos_token_id is None


def test_without_a_generation_config_config_jsons_ids_stop_generation(tmp_path):
    """No generation_config.json: transformers builds one from config.json; so does the export."""
    hf = tmp_path / "hf"
    hf_model_of(mixtral(eos_token_id=[2, 7])).save_pretrained(hf)
    (hf / "generation_config.json").unlink()
    back = _round_trip(hf, tmp_path)
    assert not (back / "generation_config.json").exists()
    assert transformers.AutoModelForCausalLM.from_pretrained(back).generation_config.eos_token_id == [2, 7]


# ---------------------------------------------------------------------------------------------
# 2. bos_token_id and pad_token_id survive, as eos_token_id does
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, tokens, expected", [
    (mixtral, {"bos_token_id": 5, "pad_token_id": 3}, (5, 3)),
    (mixtral, {"pad_token_id": -1}, (1, -1)),  # absent bos: MixtralConfig's 1; early Llama's pad -1
    (deepseek_v3, {}, (0, None)),              # DeepseekV3Config's
    (qwen3, {"bos_token_id": None}, (None, None)),
])
def test_bos_and_pad_token_ids_survive_a_round_trip(family, tokens, expected, tmp_path):
    hf = tmp_path / "hf"
    hf_model_of(family(**tokens)).save_pretrained(hf)
    config = _json(hf / "config.json")
    for key in ("bos_token_id", "pad_token_id"):
        if key not in tokens:
            config.pop(key, None)  # the config class's default
    (hf / "config.json").write_text(json.dumps(config))
    before = transformers.AutoConfig.from_pretrained(hf)
    assert (before.bos_token_id, before.pad_token_id) == expected
    back = _round_trip(hf, tmp_path)
    after = transformers.AutoConfig.from_pretrained(back)
    assert (after.bos_token_id, after.pad_token_id) == expected
    assert transformers.GenerationConfig.from_pretrained(back).to_dict() == \
        transformers.GenerationConfig.from_pretrained(hf).to_dict()


def test_train_init_from_hf_keeps_bos_pad_and_the_generation_config(tmp_path, text_corpus):
    from conftest import TINY_OVERRIDES, cli_args

    from moefold.generate import run_config

    hf = tmp_path / "hf"
    hf_model_of(qwen3(vocab_size=300, bos_token_id=5, pad_token_id=3)).save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    run = tmp_path / "run"
    assert main(["train", "--init-from-hf", str(hf), "--run-dir", str(run), *cli_args(overrides)]) == 0
    m = run_config(run).model
    assert (m.bos_token_ids, m.pad_token_ids, m.generation_eos_token_ids) == ([5], [3], [])
    assert json.loads(m.generation_config) == {"temperature": 0.6, "top_k": 20}


@pytest.mark.parametrize("value, message", [
    ("5", 'config.json: bos_token_id="5" is not a token id (an integer or null)'),
    ([5], "config.json: bos_token_id=[5] is not a token id (an integer or null)"),
    (True, "config.json: bos_token_id=true is not a token id (an integer or null)"),
])
def test_a_bos_token_id_that_is_no_id_is_refused_by_its_key(value, message, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf_model_of(mixtral()).save_pretrained(hf)
    (hf / "config.json").write_text(json.dumps({**_json(hf / "config.json"), "bos_token_id": value}))
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 3. generation_config.json's sampling defaults survive
# ---------------------------------------------------------------------------------------------


QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "repetition_penalty": 1.05, "max_new_tokens": 512, "suppress_tokens": [3, 4],
                    "bad_words_ids": [[7, 8], [9]]}


def test_generation_config_jsons_keys_survive_a_round_trip(tmp_path):
    """Qwen3's sampling defaults (its generation_config.json, transformers_version aside) were dropped."""
    hf = tmp_path / "hf"
    hf_model_of(qwen3(vocab_size=160000, hidden_size=8, head_dim=2, num_attention_heads=4,
                      num_hidden_layers=1)).save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps({**QWEN3_GENERATION, "transformers_version": "4.51.0"}))
    back = _round_trip(hf, tmp_path)
    assert _json(back / "generation_config.json") == QWEN3_GENERATION
    loaded = transformers.GenerationConfig.from_pretrained(back)
    assert (loaded.temperature, loaded.top_p, loaded.top_k, loaded.do_sample) == (0.6, 0.95, 20, True)


@pytest.mark.parametrize("text, message", [
    (json.dumps({"temperature": {"a": 1}}), 'generation_config.json: temperature={"a": 1} is not supported '
                                            '(a number, string, boolean, null or a list of them)'),
    (json.dumps({"bad_words_ids": [[1], {"a": 2}]}),
     'generation_config.json: bad_words_ids=[[1], {"a": 2}] is not supported'),
    (json.dumps({"eos_token_id": 1.5}), "generation_config.json: eos_token_id=1.5 is not a token id"),
    (json.dumps([1, 2]), "/hf/generation_config.json: not a JSON object (a JSON list)"),
    ("{", "/hf/generation_config.json: invalid JSON: "),
])
def test_a_malformed_generation_config_is_refused_by_its_key(text, message, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf_model_of(mixtral()).save_pretrained(hf)
    (hf / "generation_config.json").write_text(text)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ('generation_config = "{"', "model.generation_config='{' is not a JSON object"),
    ('generation_config = "[1]"', "model.generation_config='[1]' is not a JSON object"),
    ("bos_token_ids = [1, 2]", "model.bos_token_ids=[1, 2] cannot be exported: config.json takes one id or none"),
    ("pad_token_ids = [0, 1]", "model.pad_token_ids=[0, 1] cannot be exported"),
])
def test_a_run_config_edited_past_what_the_export_writes_is_refused_by_its_field(line, message, tmp_path, capsys):
    hf, run = tmp_path / "hf", tmp_path / "run"
    hf_model_of(mixtral()).save_pretrained(hf)
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    toml = (run / "config.toml").read_text()
    key = line.split(" = ")[0]
    (run / "config.toml").write_text(re.sub(rf"^{key} = .*$", lambda _: line, toml, count=1, flags=re.M))
    capsys.readouterr()
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "back")]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 4. DeepSeek-V3's num_nextn_predict_layers below 0: transformers builds no MTP module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [-1, -3])
def test_deepseek_num_nextn_predict_layers_below_0_is_no_mtp_module_as_in_transformers(layers, tmp_path):
    """transformers' DeepseekV3Config takes any integer there and its model builds no MTP module;
    moefold refused -1 ('model.mtp_layers must be >= 0')."""
    ours = _logits_match(deepseek_v3(num_nextn_predict_layers=layers), tmp_path)
    assert ours.cfg.model.mtp_layers == 0


# ---------------------------------------------------------------------------------------------
# 5. A converted run that has not trained never learned the byte tokenizer's end of document
# ---------------------------------------------------------------------------------------------


def test_an_untrained_converted_run_generates_past_the_byte_end_of_document_as_transformers(tmp_path, capsys):
    """A checkpoint without tokenizer.json is read with the byte tokenizer, whose end of document
    (256) ended no document the model read before it trains; the export already leaves it out of
    config.json, and transformers' generate runs past it. moefold's generate stopped there."""
    prompt = "moefold: é"
    prompt_ids = ByteTokenizer().encode(prompt)
    config = qwen3(vocab_size=300, eos_token_id=None, tie_word_embeddings=False)
    reference = hf_model_of(config)
    free = _greedy(reference, prompt_ids, 24, eos_token_id=None)
    # Swap the head's rows of the first new token t and 256: greedy then picks 256 where it picked t.
    j, t = next((j, t) for j, t in enumerate(free) if t not in free[:j] and t not in prompt_ids)
    assert 256 not in free[:j]
    with torch.no_grad():
        reference.lm_head.weight[[t, 256]] = reference.lm_head.weight[[256, t]]
    hf_ids = _greedy(reference, prompt_ids, 24, eos_token_id=None)
    assert hf_ids[j] == 256 and len(hf_ids) == 24  # ran on past it
    reference.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf" / "generation_config.json").exists() or \
        transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id is None
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "24",
                 "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == ByteTokenizer().decode(prompt_ids + hf_ids) + "\n"
