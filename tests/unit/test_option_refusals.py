"""Options the rest of the config leaves unread, or that make an option cost without effect, are
refused with one line naming both options (as model.mtp_loss_weight without MTP modules and the
yarn_* options without YaRN are), from a config file or the command line; build_moe_layer refuses
the [moe] ones too (6e746ac), except drop_policy without a capacity, a config check alone:
`moefold generate` builds its dropless layers with the run's drop_policy.
The MoE layer itself refuses a [T, D] token matrix where the sequence aux loss needs sequences."""

import pytest
import torch

from moefold.cli import main
from moefold.config import MoEConfig, load_config, preset_names
from moefold.errors import ConfigError
from moefold.moe.layer import build_moe_layer


def refused(overrides: dict, message: str, preset: str = "tiny-qwen3") -> None:
    with pytest.raises(ConfigError) as err:
        load_config(preset, overrides)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- [moe]


def test_a_drop_policy_without_a_capacity_factor_is_refused():
    """Dropless routing (moe.capacity_factor=0) drops nothing, so no policy chooses what to drop:
    drop_policy='position' trained bit for bit as 'probs'."""
    refused({"moe.drop_policy": "position"},
            "moe.drop_policy='position' needs moe.capacity_factor > 0 (dropless routing drops no token)")
    load_config("tiny-qwen3", {"moe.drop_policy": "position", "moe.capacity_factor": "1.25"})
    load_config("tiny-qwen3", {"moe.drop_policy": "probs"})  # the default, which a preset may state


def test_an_expert_bias_update_rate_without_the_expert_bias_is_refused():
    """Without moe.expert_bias there is no bias to step: the rate changed nothing."""
    refused({"moe.expert_bias_update_rate": "0.01"},
            "moe.expert_bias_update_rate=0.01 needs moe.expert_bias=true (no expert bias to update)")
    load_config("tiny-qwen3", {"moe.expert_bias_update_rate": "0.01", "moe.expert_bias": "true"})
    load_config("tiny-deepseek", {"moe.expert_bias_update_rate": "0.01"})  # the preset's bias is on


def test_the_cli_refuses_an_unread_moe_option_in_one_line(capsys, tmp_path):
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--config", "tiny-qwen3",
                 "--moe.drop_policy", "position"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "moe.drop_policy='position' needs moe.capacity_factor > 0" in err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- [model]


def test_mtp_modules_with_a_zero_mtp_loss_weight_are_refused():
    """model.mtp_layers > 0 with model.mtp_loss_weight=0: the modules run forward and backward every
    step and their loss is multiplied by 0, so the main model trains as without them."""
    refused({"model.mtp_layers": "1", "model.mtp_loss_weight": "0"},
            "model.mtp_loss_weight=0.0 with model.mtp_layers=1 trains the MTP modules on nothing; "
            "set model.mtp_layers=0")
    load_config("tiny-qwen3", {"model.mtp_layers": "1", "model.mtp_loss_weight": "0.1"})


# ----------------------------------------------------------------------------- [precision]

FP8_OPTIONS = [("fp8_exclude", '["layers.0.*"]', "['layers.0.*']"),
               ("fp8_bf16_first_layers", "1", "1"),
               ("fp8_bf16_last_layers", "1", "1"),
               ("fp8_grouped_gemm", "cutlass", "'cutlass'"),
               ("fp8_weight_grad", "bf16", "'bf16'"),
               ("fp8_saved_activations", "true", "true"),
               ("fp8_emulate", "true", "true")]


@pytest.mark.parametrize("key, value, shown", FP8_OPTIONS, ids=[k for k, _, _ in FP8_OPTIONS])
def test_an_fp8_option_without_fp8_is_refused(key, value, shown):
    """With precision.fp8='off' apply_fp8 returns before reading any of them: they changed nothing
    (fp8_weight_cache was already refused so)."""
    refused({f"precision.{key}": value}, f"precision.{key}={shown} needs precision.fp8 "
            "(tensorwise, rowwise, blockwise), not 'off'")
    load_config("tiny-qwen3", {f"precision.{key}": value, "precision.fp8": "rowwise"})


def test_the_existing_fp8_checks_still_name_their_own_rule_first():
    refused({"precision.fp8_bf16_first_layers": "3"}, "precision.fp8_bf16_first_layers=3 exceeds model.n_layers=2")
    refused({"precision.fp8_weight_cache": "true"}, "precision.fp8_weight_cache=true caches FP8 weights")


# ----------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("preset", preset_names())
def test_every_shipped_preset_still_loads(preset):
    load_config(preset)


# ----------------------------------------------------------------------------- the MoE layer


def _layer(**options) -> torch.nn.Module:
    layer = build_moe_layer(8, MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend="loop",
                                         **options), "cpu", torch.float32).train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def test_a_token_matrix_with_the_sequence_aux_loss_is_refused():
    """A [T, D] input read each token as a sequence of one: the per-sequence balance loss became
    another objective (each token balanced against itself) without a word."""
    layer = _layer(aux_loss_coeff=0.0, seq_aux_loss_coeff=0.01)
    x_TD = torch.randn(6, 8)
    with pytest.raises(ValueError) as err:
        layer(x_TD)
    assert str(err.value).startswith("MoELayer input of shape [6, 8] with moe.seq_aux_loss_coeff=0.01: "
                                     "the sequence aux loss needs [B, S, D]"), str(err.value)
    assert "\n" not in str(err.value)
    layer(x_TD[None])  # the same tokens as one sequence
    layer.eval()(x_TD)  # evaluation computes no aux loss: any token shape


def test_a_token_matrix_without_the_sequence_aux_loss_still_runs():
    layer = _layer()
    x_TD = torch.randn(6, 8)
    torch.testing.assert_close(layer(x_TD), layer(x_TD[None])[0])


# ----------------------------------------------------------------------------- found auditing config.py


def test_a_decay_fraction_outside_wsd_is_refused():
    """Only the wsd schedule reads train.decay_fraction: under cosine 0.5 trained as 0.2."""
    refused({"train.decay_fraction": "0.5"}, "train.decay_fraction=0.5 needs train.schedule='wsd'")
    refused({"train.decay_fraction": "0.5", "train.schedule": "constant"},
            "train.decay_fraction=0.5 needs train.schedule='wsd'")
    load_config("tiny-qwen3", {"train.decay_fraction": "0.5", "train.schedule": "wsd"})


def test_a_min_lr_ratio_under_the_constant_schedule_is_refused():
    """The constant schedule never decays, so it never reaches train.min_lr_ratio · lr."""
    refused({"train.min_lr_ratio": "0.5", "train.schedule": "constant"},
            "train.min_lr_ratio=0.5 needs train.schedule 'cosine' or 'wsd' (the constant schedule never decays)")
    load_config("tiny-qwen3", {"train.schedule": "constant"})
    load_config("tiny-qwen3", {"train.min_lr_ratio": "0.5", "train.schedule": "cosine"})


def test_norm_topk_prob_false_after_a_softmax_over_the_k_is_refused():
    """moe.softmax_before_topk=false takes a softmax over the K chosen, which sums to 1 already: the
    renormalisation that norm_topk_prob=false turns off changed nothing (hf_families exports either
    as norm_topk_prob=true)."""
    refused({"moe.softmax_before_topk": "false", "moe.norm_topk_prob": "false"},
            "moe.norm_topk_prob=false needs moe.softmax_before_topk=true (a softmax over the K chosen "
            "sums to 1 already)", preset="tiny-mixtral")
    load_config("tiny-mixtral")
    load_config("tiny-qwen3", {"moe.norm_topk_prob": "false"})


@pytest.mark.parametrize("key, value, shown", [("text_field", "body", "'body'"), ("token_dtype", "uint32", "'uint32'")])
def test_a_file_format_option_for_the_embedded_corpus_is_refused(key, value, shown):
    """With data.path empty the run reads the embedded corpus, plain text: no .jsonl field, no .bin dtype."""
    refused({f"data.{key}": value}, f"data.{key}={shown} needs data.path (the embedded corpus is plain text)")
    load_config("tiny-qwen3", {f"data.{key}": value, "data.path": "corpus/"})
