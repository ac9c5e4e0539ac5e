"""Edges of reading config.json (values transformers reads literally), of `convert --to-hf` and
`train --init-from-hf`, and of `moefold generate` against a naive sampler without a KV cache."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_interop import deepseek_v3, hf_model_of, mixtral, qwen3  # noqa: E402

from moefold.checkpoint.hf import config_from_hf, load_pretrained  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.fixture
def qwen_dir(tmp_path):
    """A tiny random Qwen3-MoE checkpoint (vocabulary 96, no tokenizer.json) as transformers writes it."""
    path = tmp_path / "hf"
    hf_model_of(qwen3()).save_pretrained(path)
    return path


def _config(config, **changes):
    """`config` with `changes`; a top-level rope_theta without the rope_parameters that take
    precedence over it in transformers 5's configs."""
    if "rope_theta" in changes:
        config.pop("rope_parameters", None)
    return {**config, **changes}


def _with(path, **changes):
    config = _config(json.loads((path / "config.json").read_text()), **changes)
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------
# config.json values transformers reads literally
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, changes, message", [
    # Qwen3MoeAttention: head_dim ** -0.5 of 0 (ZeroDivisionError); moefold derived dim / heads
    (qwen3, {"head_dim": 0}, "config.json: head_dim=0 must be > 0"),
    (qwen3, {"head_dim": None}, "config.json: head_dim=null must be > 0"),  # there: None ** -0.5, a TypeError
    (mixtral, {"head_dim": -8}, "config.json: head_dim=-8 must be > 0"),
    (qwen3, {"num_attention_heads": 0}, "config.json: num_attention_heads=0 must be > 0"),  # was 32 // 0
    # the inverse frequencies 1 / 0 ** (2i / d): inf; moefold took the family's default theta
    (qwen3, {"rope_theta": 0}, "config.json: rope_theta=0 must be > 0"),
    (mixtral, {"rope_theta": 0.0}, "config.json: rope_theta=0.0 must be > 0"),
    (qwen3, {"rope_theta": -1.0}, "config.json: rope_theta=-1.0 must be > 0"),
    (qwen3, {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "config.json: rope_parameters.rope_theta=0 must be > 0"),
    # transformers' Mixtral builds MoE blocks of 0 experts (top-k fails); moefold built dense layers
    (mixtral, {"num_local_experts": 0}, "config.json: num_local_experts=0 must be > 0"),
    # (i + 1) % 0: ZeroDivisionError in transformers; moefold named its own moe.moe_every
    (qwen3, {"decoder_sparse_step": 0}, "config.json: decoder_sparse_step=0 must be nonzero"),
])
def test_a_config_value_transformers_reads_literally_is_refused_by_its_key(make, changes, message):
    config = _config(make().to_dict(), **changes)
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == message


@pytest.mark.parametrize("make, changes, message", [
    # num_attention_heads // 0 in transformers; moefold's 0 is "as many as the query heads"
    (qwen3, {"num_key_value_heads": 0}, "config.json: num_key_value_heads=0 must be > 0"),
    (mixtral, {"num_key_value_heads": 0}, "config.json: num_key_value_heads=0 must be > 0"),
    # was "config.json: num_key_value_heads=4 is not supported (supported: 0)"
    (deepseek_v3, {"num_attention_heads": 0}, "config.json: num_attention_heads=0 must be > 0"),
    # transformers builds MoE layers of 0 experts; moefold imported dense layers
    (deepseek_v3, {"n_routed_experts": 0}, "config.json: n_routed_experts=0 must be > 0"),
    # E // n_group: ZeroDivisionError; moefold took no groups
    (deepseek_v3, {"n_group": 0}, "config.json: n_group=0 must be > 0"),
    (deepseek_v3, {"n_group": -1}, "config.json: n_group=-1 must be > 0"),
    # top-0 groups masks every expert's score to 0 (routing by index order); moefold ignored it
    (deepseek_v3, {"topk_group": 0}, "config.json: topk_group=0 must be > 0"),
    (deepseek_v3, {"n_group": 2, "topk_group": 3}, "config.json: topk_group=3 must be <= n_group=2"),
    # single values were named by moefold's fields ("model.dim=0 must be > 0")
    (qwen3, {"hidden_size": 0}, "config.json: hidden_size=0 must be > 0"),
    (mixtral, {"num_hidden_layers": -1}, "config.json: num_hidden_layers=-1 must be > 0"),
    (qwen3, {"moe_intermediate_size": 0}, "config.json: moe_intermediate_size=0 must be > 0"),
    (mixtral, {"intermediate_size": 0}, "config.json: intermediate_size=0 must be > 0"),
    (mixtral, {"num_experts_per_tok": 0}, "config.json: num_experts_per_tok=0 must be > 0"),
    (deepseek_v3, {"kv_lora_rank": 0}, "config.json: kv_lora_rank=0 must be > 0"),
    (deepseek_v3, {"q_lora_rank": 0}, "config.json: q_lora_rank=0 must be > 0"),  # moefold's 0: no q_a_proj
    (deepseek_v3, {"qk_rope_head_dim": 0}, "config.json: qk_rope_head_dim=0 must be > 0"),
    (deepseek_v3, {"v_head_dim": 0}, "config.json: v_head_dim=0 must be > 0"),
    # YaRN: transformers reads a given 0 as is (inverse frequencies of inf; a division by zero);
    # moefold derived the factor as max / original, and took max_position_embeddings as original
    (qwen3, {"rope_parameters": {**_YARN, "factor": 0}}, "config.json: rope_parameters.factor=0 must be > 0"),
    (qwen3, {"rope_parameters": {**_YARN, "original_max_position_embeddings": 0}},
     "config.json: rope_parameters.original_max_position_embeddings=0 must be > 0"),
    (deepseek_v3, {"rope_scaling": {**_YARN, "factor": 0.0}}, "config.json: rope_scaling.factor=0.0 must be > 0"),
    # a window of 0: transformers' mask fails ('size of tensor a (8) must match ... b (7)'); moefold's 0 is none
    (mixtral, {"sliding_window": 0}, "config.json: sliding_window=0 must be > 0"),
    (qwen3, {"use_sliding_window": True, "sliding_window": 0}, "config.json: sliding_window=0 must be > 0"),
])
def test_a_config_value_out_of_range_is_named_by_its_key(make, changes, message):
    config = _config(make().to_dict(), **changes)
    with pytest.raises(CheckpointError) as e:
        config_from_hf(config)
    assert str(e.value) == message




def test_a_refused_config_value_is_one_line_and_exit_2_from_the_cli(qwen_dir, tmp_path, capsys):
    _with(qwen_dir, rope_theta=0)
    assert main(["convert", "--from-hf", str(qwen_dir), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == ["moefold: error: config.json: rope_theta=0 must be > 0"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("make, changes, message", [
    (qwen3, {"num_experts_per_tok": 7}, "num_experts_per_tok=7 exceeds num_local_experts=6"),  # 5.x: the alias
    (mixtral, {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    (deepseek_v3, {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (qwen3, {"num_key_value_heads": 3}, "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    (deepseek_v3, {"n_group": 3, "topk_group": 1}, "n_routed_experts=8 is not divisible by n_group=3"),
    (deepseek_v3, {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok=3 exceeds the 2 experts of topk_group=1 groups"),
    # first_k_dense_replace=-1 is no dense layer, as in transformers (test_hf_generate_audit6.py)
    # num_nextn_predict_layers=-1 is no MTP module, as in transformers (test_hf_roundtrip_audit6.py)
    (qwen3, {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 must be > 0"),
    (qwen3, {"num_local_experts": -1}, "num_local_experts=-1 must be >= 0"),  # the alias transformers 5 writes
    (qwen3, {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0 must be >= 0"),
    (deepseek_v3, {"aux_loss_alpha": -1.0}, "aux_loss_alpha=-1.0 must be >= 0"),
    (deepseek_v3, {"aux_loss_alpha": -1.0, "seq_aux": False}, "aux_loss_alpha=-1.0 must be >= 0"),
    (mixtral, {"initializer_range": -1.0}, "initializer_range=-1.0 must be > 0"),
])
def test_a_config_json_the_config_check_refuses_is_named_by_its_keys(make, changes, message):
    """The checks of moefold's config named its fields ('config.json maps to an invalid moefold
    config: moe.top_k=7 exceeds moe.num_experts=6'), which a config.json does not have."""
    with pytest.raises(CheckpointError) as e:
        config_from_hf(_config(make().to_dict(), **changes))
    assert str(e.value) == f"config.json: {message}"


def test_qwen3_sliding_window_0_without_use_sliding_window_is_no_window():
    """Qwen3MoeConfig drops the window unless use_sliding_window: its 0 is never read."""
    assert config_from_hf({**qwen3().to_dict(), "sliding_window": 0}).model.sliding_window == 0


def test_qwen3_mlp_only_layers_beyond_the_model_are_ignored_as_transformers_ignores_them(tmp_path):
    """transformers asks `layer_idx not in mlp_only_layers`: 7 and -1 of a 3-layer model name no
    layer and change nothing. moefold refused the checkpoint naming its own moe.dense_layers."""
    reference = hf_model_of(qwen3(mlp_only_layers=[7, 1, -1]))
    reference.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.cfg.moe.dense_layers == [1]
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [0, None])
def test_mixtral_head_dim_0_is_derived_as_transformers_derives_it(head_dim):
    """MixtralAttention reads `head_dim or hidden_size // num_attention_heads`: 0 means derive."""
    cfg = config_from_hf({**mixtral().to_dict(), "head_dim": head_dim})
    assert cfg.model.dim // cfg.model.n_heads == 8 and cfg.model.head_dim == 8


# ---------------------------------------------------------------------------------------------
# convert --to-hf refuses from the config
# ---------------------------------------------------------------------------------------------


def _run_of_unreadable_weights(run, cfg) -> None:
    """A run of `cfg` whose only checkpoint holds one tensor, which no model of it loads, and no
    config: the run's config is its config.toml's."""
    from moefold.checkpoint.dcp import save_weights_only
    from moefold.config import to_toml

    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    save_weights_only({"unreadable": torch.zeros(1)}, run)


@pytest.mark.parametrize("preset, family", [("olmoe-1b-7b", "olmoe"), ("deepseek-v2-lite", "deepseek_v2")])
def test_convert_to_hf_refuses_a_family_before_reading_the_weights(preset, family, tmp_path, capsys):
    """A run of a family without export: refused from its config (here a checkpoint whose weights
    could not be read), not after loading a 16B model."""
    from moefold.config import load_config

    run = tmp_path / "run"
    _run_of_unreadable_weights(run, load_config(preset))
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: model.family={family!r} is not supported (supported: qwen3_moe, mixtral, deepseek_v3)"]
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_refuses_an_inexpressible_option_before_reading_the_weights(tmp_path, capsys, monkeypatch):
    import moefold.generate

    from moefold.config import load_config

    run = tmp_path / "run"
    _run_of_unreadable_weights(run, load_config(None, {"moe.force_balanced": "true"}))
    monkeypatch.setattr(moefold.generate, "load_weights", lambda *a, **k: pytest.fail("weights read"))
    assert main(["convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("moefold: error: moe.force_balanced=True cannot be saved"), err


# ---------------------------------------------------------------------------------------------
# generate: a tokenizer of more ids than the model's vocabulary
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["A", "ab"])  # ids 65 (a row of the model), 97 and 98 (none)
def test_generate_refuses_a_tokenizer_larger_than_the_models_vocabulary(prompt, qwen_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """A checkpoint of 96 ids without tokenizer.json converts to a run with the byte tokenizer
    (257 ids): its bytes are not the model's tokens. Sampling went on silently for a prompt whose
    bytes are below 96 (and never met the byte tokenizer's end of document, 256). Refused before
    the weights are read (a large model's minutes)."""
    import moefold.generate

    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(qwen_dir), "--out", str(run)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(moefold.generate, "load_weights", lambda *a, **k: pytest.fail("weights read"))
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"moefold: error: --run-dir {run}: the model's vocabulary has 96 ids, its tokenizer (data.tokenizer="
        "'', the byte-level one) 257; set data.tokenizer in its config.toml to the model's tokenizer.json"]


# ---------------------------------------------------------------------------------------------
# train --init-from-hf: an explicit model.mtp_layers of a checkpoint without MTP tensors
# ---------------------------------------------------------------------------------------------


def test_init_from_hf_refuses_an_explicit_mtp_layers_the_checkpoint_has_no_tensors_for(tmp_path, text_corpus,
                                                                                       capsys):
    """transformers saves DeepSeek-V3 with num_nextn_predict_layers 1 and no MTP tensors: such a
    checkpoint loads without MTP modules. An explicit --model.mtp_layers 1 was dropped the same
    way, without a word (the run trained without the MTP loss it asked for); --init-from-hf
    builds no module the checkpoint does not hold (any other shape change is refused too)."""
    from conftest import TINY_OVERRIDES, cli_args
    from safetensors import safe_open

    hf_dir = tmp_path / "hf"
    hf_model_of(deepseek_v3(vocab_size=300, num_nextn_predict_layers=1)).save_pretrained(hf_dir)
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        assert not [name for name in f.keys() if name.startswith("model.layers.2.")]  # 2 main layers
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "1", "train.warmup_steps": "0"})
    run = tmp_path / "run"
    capsys.readouterr()  # transformers' progress bar
    args = ["train", "--init-from-hf", str(hf_dir), "--run-dir", str(run), *cli_args(overrides)]
    assert main([*args, "--model.mtp_layers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: --model.mtp_layers 1: --init-from-hf {hf_dir} holds no MTP tensors (model.layers.2.*) "
        "to start them from; leave --model.mtp_layers out to train without MTP"]
    assert not run.exists()
    assert main(args) == 0  # config.json's default of 1, without the tensors: no MTP, as transformers loads it
    assert "mtp_layers = 0" in (run / "config.toml").read_text()


# ---------------------------------------------------------------------------------------------
# generate's sampler against a naive one
# ---------------------------------------------------------------------------------------------


def _naive_pick(logits_V, temperature, top_k, generator):
    """Keep the top-k logits (ties with the kth kept, as transformers' TopKLogitsWarper), divide
    by the temperature, softmax, draw."""
    logits_V = logits_V.double()
    if top_k:
        logits_V = logits_V.masked_fill(logits_V < logits_V.topk(top_k).values[-1], float("-inf"))
    return int(torch.multinomial((logits_V / temperature).softmax(-1), 1, generator=generator))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_k", [0, 1, 7])
def test_each_pick_is_the_naive_samplers_for_the_same_seed(temperature, top_k):
    from moefold.generate import _pick

    logits_V = 3 * torch.randn(50, generator=torch.Generator().manual_seed(top_k))
    got = [_pick(logits_V, temperature, top_k, torch.Generator().manual_seed(s)) for s in range(200)]
    want = [_naive_pick(logits_V, temperature, top_k, torch.Generator().manual_seed(s)) for s in range(200)]
    assert got == want
    if top_k:
        assert set(got) <= set(logits_V.topk(top_k).indices.tolist())


def test_an_infinite_logit_is_sampled_as_greedy_picks_it():
    """An fp16 head can overflow to +inf: greedy took that token, sampling failed in
    torch.multinomial ('probability tensor contains either inf, nan or element < 0', a traceback):
    inf - inf was NaN. The softmax's limit puts all the mass on the infinite logits."""
    from moefold.generate import _pick

    inf = float("inf")
    logits_V = torch.tensor([0.0, inf, 1.0, inf, -inf])
    assert _pick(logits_V, 0.0, 0, torch.Generator()) == 1
    picks = {_pick(logits_V, t, k, torch.Generator().manual_seed(s)) for s in range(40) for t, k in
             [(0.8, 0), (1.0, 2), (inf, 0)]}
    assert picks == {1, 3}


@pytest.mark.parametrize("vocab_size", [0, -1, 97])
def test_sample_refuses_a_vocab_size_the_model_does_not_have(vocab_size):
    """`vocab_size` cuts the logits to the tokenizer's ids: 97 of a 96-row model sampled every row
    (the tokenizer's ids beyond 95 never), -1 cut the last row off silently, 0 failed in argmax."""
    from moefold.config import load_config
    from moefold.errors import UserError
    from moefold.generate import sample
    from moefold.models.transformer import build_model

    model = build_model(load_config("tiny", {"model.vocab_size": "96"}), 96)
    model.init_weights(seed=0)
    with pytest.raises(UserError) as e:
        sample(model, [1, 2, 3], 4, 0.0, 0, 16, -1, torch.Generator(), vocab_size)
    assert str(e.value) == (f"sample: vocab_size {vocab_size} (the tokenizer's) must be in [1, 96], the "
                            "model's vocabulary")


def test_generate_of_a_converted_checkpoint_prints_transformers_greedy_continuation(tmp_path, capsys):
    """The whole command: convert --from-hf, then generate --temperature 0 prints the bytes that
    transformers' own greedy generate continues the prompt's bytes with (the byte tokenizer, whose
    257 ids the 300-row model holds; its end of document, 256, stops both)."""
    from moefold.data.tokenizer import ByteTokenizer

    reference = hf_model_of(qwen3(vocab_size=300))
    reference.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    capsys.readouterr()
    prompt = "moefold: é"
    assert main(["generate", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens", "24",
                 "--temperature", "0", "--device", "cpu"]) == 0
    prompt_ids = ByteTokenizer().encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=256, pad_token_id=0)
    new_ids = out[0, len(prompt_ids):].tolist()
    new_ids = new_ids[:new_ids.index(256)] if 256 in new_ids else new_ids
    assert len(new_ids) > 4  # a continuation to compare
    assert capsys.readouterr().out == ByteTokenizer().decode(prompt_ids + new_ids) + "\n"
