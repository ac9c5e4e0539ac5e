"""Real-shape presets on the meta device give the published parameter counts; tiny family presets
train."""

import json

import pytest

from conftest import TINY_OVERRIDES, cli_args
from moefold.cli import main
from moefold.config import load_config, preset_names
from moefold.data.tokenizer import model_vocab_size
from moefold.train.flops import (
    config_param_counts, count_params, describe_params, meta_model, train_flops_per_token)

# (total, active) in billions, as the model cards count them: embedding and output head included,
# DeepSeek-V3 without its MTP module.
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.0, 22.0),
    "deepseek-v3": (671.0, 37.0),
    "mixtral-8x7b": (46.7, 12.9),
    "olmoe-1b-7b": (6.9, 1.3),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_real_shape_parameter_counts_match_the_model_cards(preset):
    counts = count_params(meta_model(load_config(preset)))
    total, active = PUBLISHED[preset]
    assert (counts.total - counts.mtp) / 1e9 == pytest.approx(total, rel=0.02)
    assert (counts.active_with_embedding - counts.mtp_active) / 1e9 == pytest.approx(active, rel=0.02)


def test_deepseek_v3_preset_has_its_mtp_module():
    counts = count_params(meta_model(load_config("deepseek-v3")))
    # One MTP module: an MoE block plus eh_proj and norms (~11.6B; the checkpoint's 14B also holds
    # copies of the embedding and head, which we share).
    assert 11.0 < counts.mtp / 1e9 < 12.5


def test_every_preset_is_valid():
    assert {"tiny", "tiny-qwen3", "tiny-deepseek", "tiny-mixtral", *PUBLISHED} <= set(preset_names())
    for name in preset_names():
        load_config(name)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek", "tiny-mixtral"])
def test_tiny_family_presets_train(tmp_path, text_corpus, preset):
    overrides = {k: v for k, v in TINY_OVERRIDES.items() if not k.startswith(("model.", "moe."))}
    overrides.update({"data.path": str(text_corpus), "train.steps": "8", "train.seq_len": "64"})
    run = tmp_path / "run"
    assert main(["train", "--config", preset, "--run-dir", str(run), *cli_args(overrides)]) == 0
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in losses if "loss" in r]
    assert train[-1] < train[0]
    if preset == "tiny-deepseek":
        assert all("mtp_loss" in r for r in losses if "loss" in r)


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v3"])
def test_config_params_prints_the_counted_parameters(preset, capsys):
    from moefold.cli import main

    counts = count_params(meta_model(load_config(preset)))
    assert main(["config", "params", "--config", preset]) == 0
    total = capsys.readouterr().out.splitlines()[0]
    main_total = counts.total - counts.mtp
    expected = f"{main_total / 1e9:.3f}B" if main_total >= 1e9 else f"{main_total / 1e6:.2f}M"
    assert total.split()[2] == expected
    assert expected == {"tiny": "2.82M", "deepseek-v3": "671.026B"}[preset]  # the card's 671B


def test_counts_take_the_tokenizers_vocabulary_as_training_does(tmp_path, capsys):
    """model.vocab_size = 0 builds the model with data.tokenizer's vocabulary, in training and so
    in `config params` (and `plan memory`, `bench`): the byte tokenizer's 257 only without one."""
    from moefold.cli import main
    from test_data import write_hf_tokenizer

    tokenizer = write_hf_tokenizer(tmp_path / "tokenizer.json")  # 4 tokens

    def params(*options):
        capsys.readouterr()
        assert main(["config", "params", "--config", "tiny", *options]) == 0
        return capsys.readouterr().out

    with_tokenizer = params("--data.tokenizer", str(tokenizer))
    # model.vocab_size below the tokenizer's (the byte tokenizer's 257 without one) is refused
    assert with_tokenizer == params("--data.tokenizer", str(tokenizer), "--model.vocab_size", "4")
    assert with_tokenizer != params()


# Layer patterns beyond the presets': MoE every 3rd layer after 2 dense ones with 2 more dense,
# MTP blocks of both kinds (block 11 MoE, 12 and 13 dense), a dense model, an all-dense one by
# first_k_dense, a tied head with a gated shared expert, GELU experts.
PATTERNS = {
    "every-3rd-mtp-mixed": {"model.n_layers": "11", "model.mtp_layers": "3", "moe.first_k_dense": "2",
                            "moe.moe_every": "3", "moe.dense_layers": "[5, 7, 13]"},
    "dense-model": {"moe.num_experts": "0", "model.mtp_layers": "2"},
    "first-k-beyond": {"model.n_layers": "3", "moe.first_k_dense": "5"},
    "tied-gated-gelu": {"model.tie_embeddings": "true", "moe.shared_experts": "2",
                        "moe.shared_expert_gate": "true", "moe.activation": "gelu", "moe.first_k_dense": "0"},
}
CASES = [(p, {}) for p in preset_names()] + [("tiny", o) for o in PATTERNS.values()]


@pytest.mark.parametrize("preset, overrides", CASES, ids=[*preset_names(), *PATTERNS])
def test_config_params_counts_as_the_whole_built_model(preset, overrides):
    """`config params` counts one block of each kind times their number; every figure it prints
    is the one of the model built layer by layer on the meta device."""
    cfg = load_config(preset, overrides)
    model = meta_model(cfg)
    assert config_param_counts(cfg, model_vocab_size(cfg)) == count_params(model)
    flops = train_flops_per_token(model, cfg.train.seq_len)
    per_token = f"{flops / 1e9:.2f} GFLOP" if flops >= 1e9 else f"{flops / 1e6:.2f} MFLOP"
    assert describe_params(cfg).endswith(f"; {per_token} per token at sequence {cfg.train.seq_len} (fwd+bwd)")


def test_config_params_of_a_huge_model_builds_one_block_of_each_kind(monkeypatch, capsys):
    """10^8 layers (DeepSeek-V3's dense, MoE and MTP blocks): counted from a dense and an MoE block,
    not built layer by layer (which ran out of time and memory), as the planner's per-module
    formulas count them."""
    import time

    from moefold.models import transformer
    from moefold.plan.params import model_params

    built, build_block = [], transformer._build_block

    def counted_build_block(*args, **kwargs):
        built.append(args[1])
        assert len(built) <= 2, "config params builds the model layer by layer"
        return build_block(*args, **kwargs)

    monkeypatch.setattr(transformer, "_build_block", counted_build_block)
    overrides = {"model.n_layers": "100000000"}
    cfg = load_config("deepseek-v3", overrides)
    start = time.perf_counter()
    assert main(["config", "params", "--config", "deepseek-v3", *cli_args(overrides)]) == 0
    assert time.perf_counter() - start < 5
    assert len(built) == 2
    monkeypatch.undo()
    counts = config_param_counts(cfg, model_vocab_size(cfg))
    assert counts.total == model_params(cfg, model_vocab_size(cfg)).total
    assert capsys.readouterr().out.splitlines()[0].split()[2] == f"{(counts.total - counts.mtp) / 1e9:.3f}B"
