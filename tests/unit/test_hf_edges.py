"""Hugging Face interop at its edges: checkpoints and configs that are damaged or unusual, each
refused in one line naming the file and tensor (or loaded exactly as transformers loads them)."""

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_hf_interop import VOCAB, assert_rel_close, deepseek_v3, hf_model_of, qwen3  # noqa: E402

from moefold.checkpoint.hf import INDEX, config_from_hf, load_pretrained, pretrained_on_meta  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint in several shards with an index, as transformers writes it."""
    path = tmp_path_factory.mktemp("sharded") / "hf"
    hf_model_of(qwen3()).save_pretrained(path, max_shard_size="20KB")
    assert (path / INDEX).is_file()
    return path


def test_an_index_naming_a_shard_without_the_tensor_is_a_one_line_error(sharded, tmp_path, capsys):
    """An index out of date with its shards (one re-sharded, or copied from another download) sends
    a tensor to a file that does not hold it: refused from the files' headers, naming both, not a
    SafetensorError traceback when the tensor is read."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    index = json.loads((path / INDEX).read_text())
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (path / INDEX).write_text(json.dumps(index))
    message = f"{INDEX} puts {name} in {other}, which does not hold it"
    with pytest.raises(CheckpointError, match=message):
        pretrained_on_meta(path)  # before any weight is allocated: every rank refuses it alike
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not run.exists()


@pytest.mark.parametrize("unreadable", ["config.json", INDEX, "model-00002-of-00012.safetensors"])
def test_a_checkpoint_file_that_cannot_be_read_is_a_one_line_error(unreadable, sharded, tmp_path, capsys,
                                                                    monkeypatch):
    """Permission denied (a download another user owns) on config.json, the index or a shard: a
    one-line error naming the file, exit 2, as data files are; not an OSError traceback. safetensors
    raises a bare OSError (no errno) when it cannot open a file."""
    import safetensors

    path = shutil.copytree(sharded, tmp_path / "hf")
    denied = path / unreadable
    real_read_text, real_safe_open = Path.read_text, safetensors.safe_open

    def read_text(self, *args, **kwargs):
        if self == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    def safe_open(file, *args, **kwargs):
        if Path(file) == denied:
            raise OSError("Permission denied (os error 13)")
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(denied))}: cannot be read \(Permission denied"):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{denied}: cannot be read (Permission denied" in err[0]
    assert not run.exists()


@pytest.mark.parametrize("file, content", [
    ("config.json", "{}".encode("utf-16")),  # as PowerShell's Out-File writes it
    ("config.json", b"[]"),
    (INDEX, b'["model-00001-of-00012.safetensors"]'),
])
def test_a_json_file_that_is_no_json_object_is_a_one_line_error(file, content, sharded, tmp_path, capsys):
    """config.json or the index in another encoding than UTF-8, or a JSON value that is not an
    object: one line naming the file, exit 2; not a UnicodeDecodeError or AttributeError traceback.
    `train --init-from-hf` reads config.json on its own path and refuses it alike."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    (path / file).write_bytes(content)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (f"{path / file}: invalid JSON" in err[0] or "not a JSON object" in err[0]), err
    assert not run.exists()
    if file == "config.json":
        assert main(["train", "--init-from-hf", str(path), "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "config.json" in err[0], err
        assert not run.exists()


@pytest.mark.parametrize("window", ["absent", None, 6])
@pytest.mark.parametrize("use", [True, False])
def test_qwen3_sliding_window_is_the_one_transformers_reads(window, use, tmp_path):
    """Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and an explicit null
    stays null (full attention) where an absent key is its default 4096."""
    config = qwen3(use_sliding_window=use).to_dict()
    del config["sliding_window"]
    if window != "absent":
        config["sliding_window"] = window
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).sliding_window
    assert config_from_hf(config).model.sliding_window == (theirs or 0)


def test_qwen3_null_sliding_window_attends_past_4096_tokens_as_transformers_does(tmp_path):
    """use_sliding_window with sliding_window null: transformers attends over the whole causal
    context; a 4096-token window would change every logit past position 4096."""
    hf = hf_model_of(qwen3(num_hidden_layers=1, use_sliding_window=True, sliding_window=None), attn="sdpa")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["use_sliding_window"] is True and config["sliding_window"] is None
    ours = load_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 4096 + 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = hf(ids).logits[0, -8:], ours(ids)[0, -8:]
    assert_rel_close(actual, expected, 1e-5, "logits past position 4096")


@pytest.mark.parametrize("key, value, message", [
    ("num_hidden_layers", "3", 'num_hidden_layers="3" is not an integer (a JSON string)'),
    ("num_hidden_layers", [3], "num_hidden_layers=[3] is not an integer (a JSON array)"),
    ("num_hidden_layers", 3.5, "num_hidden_layers=3.5 is not an integer (a JSON number with a decimal point"),
    ("num_hidden_layers", 3.0, "num_hidden_layers=3.0 is not an integer (a JSON number with a decimal point"),
    ("vocab_size", True, "vocab_size=true is not an integer (a JSON boolean)"),
    ("rms_norm_eps", "1e-6", 'rms_norm_eps="1e-6" is not a number (a JSON string)'),
    ("norm_topk_prob", "yes", 'norm_topk_prob="yes" is not true or false (a JSON string)'),
    ("mlp_only_layers", ["1"], 'mlp_only_layers=["1"] is not a list of integers'),
    ("rope_parameters", {"rope_type": "yarn", "factor": "4"}, 'rope_parameters.factor="4" is not a number'),
])
def test_a_config_value_of_the_wrong_json_type_is_a_one_line_error(key, value, message, sharded, tmp_path,
                                                                    capsys):
    """A value of another JSON type than the key's (a string, a list, 3.0 layers) ended convert and
    --init-from-hf in a TypeError traceback: one line naming config.json, the key and what it must
    be, exit 2, no run. transformers' config classes refuse the same values (3.0 layers too)."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    if key != "rope_parameters":  # transformers checks that dict's values only as it uses them
        with pytest.raises(Exception, match=key):
            transformers.AutoConfig.from_pretrained(path)
    run = tmp_path / "run"
    for command in (["convert", "--from-hf", str(path), "--out", str(run)],
                    ["train", "--init-from-hf", str(path), "--run-dir", str(run)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"config.json: {message}" in err[0], err
        assert not run.exists()


def test_an_integer_where_a_number_belongs_is_that_number(sharded):
    """Some tools write 1.0 as 1: an integer where a float belongs is read as that float, as a
    moefold TOML config reads it (transformers 5's config classes refuse it)."""
    config = json.loads((sharded / "config.json").read_text())
    config.update(router_aux_loss_coef=0, rms_norm_eps=1)
    cfg = config_from_hf(config)
    assert (cfg.moe.aux_loss_coeff, cfg.model.norm_eps) == (0.0, 1.0)
    assert type(cfg.moe.aux_loss_coeff) is float and type(cfg.model.norm_eps) is float


@pytest.mark.parametrize("value", ["absent", None, True, False])
@pytest.mark.parametrize("key", ["norm_topk_prob", "rope_interleave", "seq_aux"])
def test_deepseek_v3_flags_are_the_ones_transformers_reads(key, value, tmp_path):
    """DeepseekV3Config keeps a null flag null, and its modeling reads it as false (`if
    config.rope_interleave:`); an absent key is the class's default, true. seq_aux is DeepSeek's
    own MoEGate's (`if self.seq_aux:`; true by default), which transformers keeps as it reads it."""
    config = deepseek_v3().to_dict()
    config.pop(key, None)
    if value != "absent":
        config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = bool(getattr(transformers.AutoConfig.from_pretrained(tmp_path), key, True))
    cfg = config_from_hf(config)
    ours = {"norm_topk_prob": cfg.moe.norm_topk_prob, "rope_interleave": cfg.model.rope_interleaved,
            "seq_aux": cfg.moe.seq_aux_loss_coeff > 0}[key]
    assert ours == theirs


def test_deepseek_v3_null_flags_route_and_rotate_as_transformers_does(tmp_path):
    """norm_topk_prob and rope_interleave null (DeepseekV3Config(norm_topk_prob=None, ...) writes
    that): transformers neither renormalises the top-k weights nor interleaves RoPE; reading null
    as the default true changed every logit."""
    hf = hf_model_of(deepseek_v3(norm_topk_prob=None, rope_interleave=None))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["norm_topk_prob"] is None and config["rope_interleave"] is None
    ours = load_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = hf(ids).logits, ours(ids)
    assert_rel_close(actual, expected, 1e-5, "logits")


@pytest.mark.parametrize("data", ["text", "token files with data.eos_id"])
def test_an_export_stops_transformers_generate_at_the_runs_end_of_document(data, tmp_path, tiny_args):
    """convert --to-hf wrote no eos_token_id, so transformers' generate() on the export never
    stopped at the end of a document (and a DeepSeek-V3 or Mixtral export took its config class's
    ids, other tokens here): config.json now holds the id the run's documents ended with (the byte
    tokenizer's 256; data.eos_id on token files), which generate() takes without a
    generation_config.json, and no beginning-of-sequence id (moefold trains without one)."""
    import numpy as np

    args = ["--train.steps", "1", "--train.warmup_steps", "0"]
    eos = 256
    if data != "text":
        eos = 10
        rng = np.random.default_rng(0)
        docs = [np.append(rng.integers(11, 200, size=int(n)), eos) for n in rng.integers(20, 60, size=80)]
        np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
        args += ["--data.path", str(tmp_path / "tokens.npy"), "--data.eos_id", str(eos)]
    run, export = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--run-dir", str(run), *tiny_args, *args]) == 0
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(export)]) == 0
    assert config_from_hf(json.loads((export / "config.json").read_text())).model.n_layers == 2  # import reads it
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert (model.config.eos_token_id, model.config.bos_token_id) == (eos, None)
    assert model.generation_config.eos_token_id == eos

    class EndOfDocumentNext(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, eos] = scores.max() + 1
            return scores

    out = model.generate(torch.tensor([[65, 66]]), max_new_tokens=5, do_sample=False,
                         logits_processor=[EndOfDocumentNext()])
    assert out.tolist() == [[65, 66, eos]]


def test_a_tensor_with_no_place_in_the_model_is_named_with_its_file(sharded, tmp_path, capsys):
    """The error named the tensor and the checkpoint directory but not which of its shards holds
    the tensor (a leftover of another model, a file to replace or delete)."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    index = json.loads((path / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    tensors = safetensors_torch.load_file(path / shard)
    safetensors_torch.save_file({**tensors, "model.layers.0.mlp.experts.99.up_proj.weight": torch.zeros(2, 2)},
                                path / shard, metadata={"format": "pt"})
    index["weight_map"]["model.layers.0.mlp.experts.99.up_proj.weight"] = shard
    (path / INDEX).write_text(json.dumps(index))
    message = f"1 tensor(s) with no place in the model: model.layers.0.mlp.experts.99.up_proj.weight (in {shard})"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {path}: {message}" in err[0], err
    assert not run.exists()


def test_yarn_without_a_factor_or_lengths_is_a_one_line_error(sharded, tmp_path, capsys):
    """YaRN without a factor key (transformers refuses it too) and without the lengths to derive one
    from was 0 / 0, a ZeroDivisionError traceback."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    config.pop("max_position_embeddings", None)
    config.update(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0})
    (path / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--from-hf", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moefold: error: config.json: rope_parameters is yarn without a factor (transformers requires "
                   "the key); give rope_parameters.factor, or null for max_position_embeddings / "
                   "original_max_position_embeddings"]
    assert not (tmp_path / "run").exists()
