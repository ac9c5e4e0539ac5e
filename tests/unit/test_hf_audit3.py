"""Hugging Face interop audit: what an export's config.json claims (end-of-document id, dtype keys),
the fp32 router rule in every conversion, checkpoints without MTP layers, and round trips of each
family against transformers' own model."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_interop import VOCAB, deepseek_v3, hf_model_of, qwen3  # noqa: E402

from moefold.checkpoint.hf import (  # noqa: E402
    config_from_hf, convert_to_run_checkpoint, hf_config_from, load_pretrained, save_pretrained)
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402

transformers.logging.set_verbosity_error()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# 1. eos_token_id of an export whose run has no tokenizer.json
# ---------------------------------------------------------------------------------------------


def test_an_export_claims_no_end_of_document_id_outside_its_vocabulary(tmp_path):
    """A checkpoint without tokenizer.json converts to a run with the byte-level tokenizer, whose
    end of document is 256; exported back, config.json said eos_token_id=256 for a vocabulary of
    96 rows (no such token). Now it says the checkpoint's own 7 (kept since test_hf_generate_audit6.py),
    and where the checkpoint states none, null: transformers' generate runs to max_new_tokens.
    Its bos_token_id 5 is kept too (test_hf_roundtrip_audit6.py; it was null)."""
    for eos in (7, None):
        hf, run, back = tmp_path / f"hf{eos}", tmp_path / f"run{eos}", tmp_path / f"back{eos}"
        hf_model_of(qwen3(eos_token_id=eos, bos_token_id=5)).save_pretrained(hf)
        assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
        assert main(["convert", "--run-dir", str(run), "--to-hf", str(back)]) == 0
        config = _config(back)
        assert config["vocab_size"] == VOCAB
        assert (config["eos_token_id"], config["bos_token_id"]) == (eos, 5)
        model = transformers.AutoModelForCausalLM.from_pretrained(back)
        assert model.generation_config.eos_token_id == eos
    out = model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 5)


def test_an_untrained_conversion_claims_not_the_byte_tokenizers_end_of_document(tmp_path, text_corpus):
    """A checkpoint of 300 tokens ending documents with 7 and without tokenizer.json converts to a
    run with the byte tokenizer; exported back untrained, config.json said eos_token_id=256, a
    token of the checkpoint's own vocabulary that ended none of its documents (transformers'
    generate would stop at it). Now the checkpoint's 7 until the run trains on bytes, then 7 and
    256, as it learned (test_hf_generate_audit6.py keeps config.json's and generation_config.json's ids)."""
    from conftest import TINY_OVERRIDES, cli_args

    hf, run = tmp_path / "hf", tmp_path / "run"
    hf_model_of(qwen3(vocab_size=300, eos_token_id=7)).save_pretrained(hf)
    assert main(["convert", "--from-hf", str(hf), "--out", str(run)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "untrained")]) == 0
    assert _config(tmp_path / "untrained")["eos_token_id"] == 7
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    assert main(["train", "--resume", str(run), *cli_args(overrides)]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "trained")]) == 0
    assert _config(tmp_path / "trained")["eos_token_id"] == 7  # as imported; generate reads this:
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "trained")
    assert generation.eos_token_id == [7, 256]


def test_save_pretrained_refuses_an_end_of_document_id_outside_the_vocabulary(tmp_path):
    model = load_pretrained(_saved(qwen3(), tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"eos_token_id=96 is not a token of the model's vocabulary \(0\.\.95\)"):
        save_pretrained(model, tmp_path / "out", eos_token_id=VOCAB)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="eos_token_id=-1"):
        hf_config_from(model.cfg, VOCAB, eos_token_id=-1)
    assert hf_config_from(model.cfg, VOCAB, eos_token_id=VOCAB - 1)["eos_token_id"] == VOCAB - 1


def _saved(hf_config, path: Path, **kw) -> Path:
    hf_model_of(hf_config).save_pretrained(path, **kw)
    return path


# ---------------------------------------------------------------------------------------------
# 2. config.json's dtype key: transformers 5 writes `dtype`, earlier versions `torch_dtype`
# ---------------------------------------------------------------------------------------------


def test_a_checkpoint_whose_config_says_only_dtype_loads_with_its_values(tmp_path):
    """transformers 5 writes `dtype` (no `torch_dtype`); moefold's import takes the dtype it is
    asked for whichever key is there, keeping the checkpoint's values."""
    hf = tmp_path / "hf"
    hf_model_of(qwen3()).to(torch.bfloat16).save_pretrained(hf)
    config = _config(hf)
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    tensors = safetensors_torch.load_file(hf / "model.safetensors")
    model = load_pretrained(hf)
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert torch.equal(model.tok_embeddings.weight, tensors["model.embed_tokens.weight"].float())
    assert load_pretrained(hf, dtype=torch.bfloat16).tok_embeddings.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_export_states_its_dtype_under_both_keys(dtype, tmp_path):
    """`dtype` for transformers >= 4.56 (what its own save writes; it keeps `dtype` where both are
    given), `torch_dtype` for earlier versions and tools that read that key: the same value."""
    model = load_pretrained(_saved(qwen3(), tmp_path / "hf"))
    save_pretrained(model, tmp_path / "out", dtype=dtype)
    config = _config(tmp_path / "out")
    name = str(dtype).removeprefix("torch.")
    assert (config["dtype"], config["torch_dtype"]) == (name, name)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").dtype == dtype
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == dtype


# ---------------------------------------------------------------------------------------------
# 3. The tensors transformers holds in fp32, in every conversion
# ---------------------------------------------------------------------------------------------


def _run_checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(checkpoint.parent / "whole.pt"))
    return torch.load(checkpoint.parent / "whole.pt")["model"]


def test_a_bf16_run_checkpoint_keeps_deepseeks_router_in_fp32(tmp_path):
    """convert_to_run_checkpoint(dtype=bf16) rounded DeepSeek-V3's router weight to bf16, where
    load_pretrained(dtype=bf16), convert --to-hf --dtype bf16 and transformers hold it in fp32
    (its _keep_in_fp32_modules_strict): the same checkpoint as load_pretrained's state dict."""
    hf = _saved(deepseek_v3(), tmp_path / "hf")
    theirs = safetensors_torch.load_file(hf / "model.safetensors")
    _, checkpoint = convert_to_run_checkpoint(hf, tmp_path / "run", dtype=torch.bfloat16)
    ours = _run_checkpoint_tensors(checkpoint)
    router = ours["layers.1.ffn.router.weight"]
    assert router.dtype == torch.float32
    assert torch.equal(router, theirs["model.layers.1.mlp.gate.weight"])
    assert ours["layers.1.ffn.router.expert_bias_E"].dtype == torch.float32
    assert ours["layers.1.ffn.experts.w1_EDF"].dtype == torch.bfloat16
    reference = load_pretrained(hf, dtype=torch.bfloat16).state_dict()
    assert ours.keys() == reference.keys()
    for name, t in reference.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


# ---------------------------------------------------------------------------------------------
# 4. A DeepSeek-V3 checkpoint without MTP layers (every one transformers saves)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["written", "absent"])
def test_a_deepseek_checkpoint_without_mtp_tensors_loads_without_mtp_silently(key, tmp_path, capsys):
    """transformers' DeepseekV3 has no MTP layer: its save writes num_nextn_predict_layers=1 (its
    config's default) and no layer-L tensors, and its load builds none and says nothing. moefold
    warned 'config.json asks for 1 MTP layer(s) ...' on every such checkpoint; it now builds no
    MTP module, as transformers, silently."""
    hf = _saved(deepseek_v3(num_nextn_predict_layers=1), tmp_path / "hf")
    config = _config(hf)
    assert config["num_nextn_predict_layers"] == 1
    if key == "absent":
        del config["num_nextn_predict_layers"]
        (hf / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' save's progress bar
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_pretrained(hf)
        assert model.mtp is None and model.cfg.model.mtp_layers == 0
        assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err == ""
    assert "mtp_layers = 0" in (tmp_path / "run" / "config.toml").read_text()


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "hf"
    hf_model_of(qwen3()).save_pretrained(path, max_shard_size="20KB")
    return path


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = {**_config(src), **changes}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _one_line_exit_2(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("value", [["qwen3_moe"], 3, {"name": "qwen3_moe"}])
def test_a_model_type_that_is_no_string_is_a_one_line_error(value, sharded_qwen, tmp_path, capsys):
    """model_type as a list (or any unhashable JSON value) ended convert --from-hf and
    --init-from-hf in a TypeError traceback ('unhashable type: list')."""
    hf = _with_config(sharded_qwen, tmp_path / "hf", model_type=value)
    expected = f"config.json: model_type={value!r} is not supported"
    assert expected in _one_line_exit_2(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], capsys)
    assert not (tmp_path / "run").exists()
    assert expected in _one_line_exit_2(["train", "--init-from-hf", str(hf), "--run-dir", str(tmp_path / "train"),
                                         "--train.steps", "1", "--train.warmup_steps", "0"], capsys)
    with pytest.raises(CheckpointError, match="model_type="):
        config_from_hf(_config(hf))


# ---------------------------------------------------------------------------------------------
# Round trips moefold -> Hugging Face -> moefold, tied and sharded, against transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, extra", [
    ("tiny-deepseek", {"model.mtp_layers": "1"}),  # MTP's copy of the head is the tied embedding
    ("tiny-mixtral", {}),
    ("tiny-qwen3", {}),
])
def test_a_tied_model_exports_sharded_and_comes_back(preset, extra, tmp_path):
    """A moefold model with a tied head, written in shards with an index: transformers loads it
    with moefold's logits (lm_head not written: tied), moefold loads it back bit for bit, and
    transformers' own save of it loads into moefold with transformers' logits."""
    from test_hf_interop import SEQ, assert_rel_close, hf_load, randomize_ours

    from moefold.config import load_config
    from moefold.models.transformer import build_model

    cfg = load_config(preset, {"model.vocab_size": str(VOCAB), "model.tie_embeddings": "true", **extra})
    ours = build_model(cfg, VOCAB)
    randomize_ours(ours, seed=5)
    save_pretrained(ours.eval(), tmp_path / "ours", max_shard_bytes=30_000)
    files = {p.name for p in (tmp_path / "ours").iterdir()}
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert _config(tmp_path / "ours")["tie_word_embeddings"] is True
    hf, info = hf_load(tmp_path / "ours")
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (2, 2 * SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
    again = load_pretrained(tmp_path / "ours")
    assert again.output.weight is again.tok_embeddings.weight
    assert again.cfg.model.mtp_layers == cfg.model.mtp_layers
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    hf.save_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        assert_rel_close(load_pretrained(tmp_path / "theirs")(ids), hf(ids).logits, 1e-5, "logits")


@pytest.mark.parametrize("value", [0, -5])
def test_a_vocab_size_below_one_is_a_one_line_error_naming_it(value, sharded_qwen, tmp_path, capsys):
    """vocab_size 0 is moefold's 'the tokenizer's vocabulary' but no vocabulary in config.json: it
    was refused as 'lm_head.weight has shape [96, 32], the model expects [0, 32]' after a torch
    warning about zero-element tensors (two lines), blaming the weights."""
    hf = _with_config(sharded_qwen, tmp_path / "hf", vocab_size=value)
    line = _one_line_exit_2(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], capsys)
    assert line == f"moefold: error: config.json: vocab_size={value} must be positive"


# ---------------------------------------------------------------------------------------------
# A directory holding both a single file and an index
# ---------------------------------------------------------------------------------------------


def test_a_stale_index_beside_model_safetensors_loads_the_single_file_as_transformers_does(tmp_path, capsys):
    """transformers' save_pretrained as one file into a directory it had saved in shards removes
    the shards but leaves model.safetensors.index.json; its from_pretrained loads model.safetensors.
    moefold read the index first and refused the directory ('... names model-00001-of-00012.safetensors,
    which does not exist'); it now loads model.safetensors, as transformers does."""
    hf = tmp_path / "hf"
    hf_model_of(qwen3(), seed=1).save_pretrained(hf, max_shard_size="20KB")
    hf_model_of(qwen3(), seed=2).save_pretrained(hf)
    assert (hf / "model.safetensors.index.json").is_file() and not list(hf.glob("model-*.safetensors"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf)
    ours = load_pretrained(hf)
    assert torch.equal(ours.norm.weight, theirs.model.norm.weight)
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 0


def test_both_a_single_file_and_a_complete_index_are_a_one_line_error(tmp_path, capsys):
    """Saved in shards over a single file, the directory keeps both (transformers removes only
    shards) and transformers loads the older model.safetensors: which one is meant is unknowable,
    so moefold names both instead of picking one."""
    hf = tmp_path / "hf"
    hf_model_of(qwen3(), seed=1).save_pretrained(hf)
    hf_model_of(qwen3(), seed=2).save_pretrained(hf, max_shard_size="20KB")
    assert (hf / "model.safetensors").is_file() and (hf / "model.safetensors.index.json").is_file()
    line = _one_line_exit_2(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], capsys)
    assert line == (f"moefold: error: {hf}: holds both model.safetensors and model.safetensors.index.json "
                    "with its shards (one is left over from an earlier save); remove the one that is not "
                    "this checkpoint (transformers loads model.safetensors)")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# --init-from-hf's tokenizer, given a relative directory
# ---------------------------------------------------------------------------------------------


def _bpe_tokenizer(path: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return path


def test_init_from_hf_of_a_relative_directory_keeps_its_tokenizer_from_anywhere(tmp_path, text_corpus,
                                                                               monkeypatch):
    """`train --init-from-hf hf` (relative) wrote `data.tokenizer = "hf/tokenizer.json"` into the
    run's config.toml, resolved against whatever directory a later command runs in: `convert
    --to-hf` or `train --resume` from elsewhere found no tokenizer. It is now absolute, as
    `convert --from-hf` writes it."""
    from conftest import TINY_OVERRIDES, cli_args

    pytest.importorskip("tokenizers")
    hf = tmp_path / "hf"
    hf_model_of(qwen3(vocab_size=300)).save_pretrained(hf)
    texts = [p.read_text() for p in sorted(text_corpus.rglob("*.txt"))[:20]]
    _bpe_tokenizer(hf / "tokenizer.json", texts)
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--init-from-hf", "hf", "--run-dir", "run", *cli_args(overrides)]) == 0
    assert f'tokenizer = "{hf / "tokenizer.json"}"' in (tmp_path / "run" / "config.toml").read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["convert", "--run-dir", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
