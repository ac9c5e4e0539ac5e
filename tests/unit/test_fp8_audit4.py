"""FP8 runs (the CPU emulation) with checkpoints and the Hugging Face export: the FP8 modules share
the model's parameters, so a checkpoint and an export hold what a bf16 run's would, and nothing of
FP8 (no scale or cached-weight buffer)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moefold.checkpoint.dcp import _read_metadata
from moefold.checkpoint.hf import save_pretrained
from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.apply import apply_fp8
from moefold.generate import load_model_from_run
from moefold.models.transformer import build_model
from moefold.train.trainer import Trainer

FP8 = {"precision.fp8": "rowwise", "precision.fp8_weight_cache": "true",
       "precision.fp8_saved_activations": "true", "precision.fp8_emulate": "true", "train.grad_accum": "2"}
DEEPSEEK = {"model.mtp_layers": "1"}


def _cfg(corpus: Path, extra: dict) -> object:
    return load_config("tiny-deepseek", {
        "data.path": str(corpus), "train.seq_len": "16", "train.micro_batch_size": "2", "train.steps": "2",
        "train.warmup_steps": "1", "train.val_every": "0", "data.val_fraction": "0", "train.device": "cpu",
        "logging.tensorboard": "false", "logging.progress_bar": "false", "logging.expert_load_heatmap": "false",
        "checkpoint.save_at_end": "false", **DEEPSEEK, **extra})


def _trained(corpus: Path, run_dir: Path, extra: dict) -> Trainer:
    trainer = Trainer(_cfg(corpus, extra), run_dir, out=lambda line: None)
    while trainer.step < trainer.cfg.train.steps:
        trainer.accumulate_gradients()
        trainer.optimizer_step()
        trainer.step += 1
    trainer.saved = trainer.save()
    return trainer


def _exported(model, path: Path) -> dict[str, torch.Tensor]:
    save_pretrained(model, path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_an_fp8_runs_checkpoint_and_export_hold_what_a_bf16_runs_do(text_corpus, tmp_path):
    """Every tensor name the bf16 run's checkpoint and export hold, no other; the export of the FP8
    run's checkpoint (convert --to-hf's path: a model built without FP8) equals the export of the
    live FP8 model bit for bit."""
    fp8 = _trained(text_corpus, tmp_path / "fp8", FP8)
    plain = _trained(text_corpus, tmp_path / "plain", {"train.grad_accum": "2"})
    assert any(name.startswith("fp8_") for name, _ in fp8.model.named_buffers(recurse=True)
               for name in [name.rsplit(".", 1)[-1]])  # the cache is there to leak
    assert set(_read_metadata(fp8.saved).state_dict_metadata) == set(_read_metadata(plain.saved).state_dict_metadata)
    live = _exported(fp8.model, tmp_path / "hf-live")
    model, _, _ = load_model_from_run(tmp_path / "fp8", "cpu", exact_masters=True)
    converted = _exported(model, tmp_path / "hf-converted")
    assert live.keys() == converted.keys() == _exported(plain.model, tmp_path / "hf-plain").keys()
    for name, t in live.items():
        assert torch.equal(t, converted[name]), name


def _converted(over: dict) -> list[str]:
    cfg = load_config("tiny-deepseek", {"model.mtp_layers": "1", "precision.fp8": "rowwise", **over})
    with torch.device("meta"):
        model = build_model(cfg, 256, "cpu", torch.float32)
    return apply_fp8(model, cfg.precision, "cpu", compute_dtype=torch.float32)


def _blocks(names: list[str]) -> set[str]:
    return {name.split(".attn")[0].split(".ffn")[0] for name in names}


def test_fp8_exclude_and_the_bf16_layers_count_blocks_with_mtp_and_a_dense_first_layer():
    """tiny-deepseek: 3 main blocks (layer 0 dense, moe.first_k_dense=1) and one MTP block. Patterns
    naming modules that never run in FP8 (router, embeddings, head, norms, MTP's eh_proj) change
    nothing; a pattern naming no module (a parameter's name, MTP's modules without MTP) is refused;
    the first N count the dense layer, the last N the main stack only (not the MTP block)."""
    every = _converted({})
    assert _blocks(every) == {"layers.0", "layers.1", "layers.2", "mtp.layers.0.block"}
    never = '["layers.*.ffn.router", "tok_embeddings", "output", "norm", "layers.*_norm", "mtp.layers.0.eh_proj"]'
    assert _converted({"precision.fp8_exclude": never}) == every
    for pattern, over in (("layers.0.attn.wo.weight", {}), ("mtp.*", {"model.mtp_layers": "0"})):
        with pytest.raises(ConfigError, match="matches no module name"):
            _converted({"precision.fp8_exclude": f'["{pattern}"]', **over})
    assert _blocks(_converted({"precision.fp8_bf16_first_layers": "1"})) == _blocks(every) - {"layers.0"}
    assert _blocks(_converted({"precision.fp8_bf16_last_layers": "1"})) == _blocks(every) - {"layers.2"}
    assert _blocks(_converted({"precision.fp8_bf16_first_layers": "3"})) == {"mtp.layers.0.block"}
    assert _blocks(_converted({"precision.fp8_exclude": '["mtp.*"]', "precision.fp8_bf16_last_layers": "2"})) \
        == {"layers.0"}


@pytest.mark.parametrize("over", [{"precision.fp8_exclude": '["*.experts"]', "model.mtp_layers": "0"},
                                  {"precision.fp8_bf16_first_layers": "3", "precision.fp8_exclude": '["mtp.*"]'}])
def test_a_weight_cache_without_fp8_experts_is_refused(over, text_corpus, tmp_path):
    """precision.fp8_weight_cache caches the FP8 routed experts' weights: where every expert stays
    in high precision it did nothing, without a word (the run trained as without it), as a
    memory.recompute name without a site would."""
    with pytest.raises(ConfigError, match=r"^precision.fp8_weight_cache=true does nothing here: no routed experts "
                                          r"run in FP8"):
        Trainer(_cfg(text_corpus, {**FP8, **over}), tmp_path / "run", out=lambda line: None)
    assert _converted({"precision.fp8_weight_cache": "true", "precision.fp8_exclude": '["layers.*.ffn.experts"]'})
