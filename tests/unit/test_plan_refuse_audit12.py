"""The plan's build checks (plan/refuse.py) build a model of one layer per kind the planner sees
(plan.layers' runs) instead of the whole model: before, they built every layer on the meta device
and applied FP8 to it (~5 ms a layer: `moefold plan memory --config deepseek-v3 --precision.fp8
rowwise --model.n_layers 100000000` took hours).

Reference: the whole model built and converted as the trainer does (`_whole_model_refusal`, the
code refuse.py ran before), whose first error (or none) the new checks must give word for word, on
configs covering each FP8 recipe, fp8_exclude patterns with and without layer numbers and matching
nothing, the bf16 first/last layers, MTP, misaligned model and expert sizes, ETP and TP shards and
the grouped_mm experts backend."""

import signal
import time

import pytest
import torch

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.apply import apply_fp8
from moefold.models.transformer import build_model
from moefold.plan.refuse import refuse_unbuildable
from moefold.train.flops import tensor_sizes

VOCAB = 256
BF16, FP32 = torch.bfloat16, torch.float32

# tiny-deepseek (MLA, a shared expert, one MTP block, dim 64, experts' hidden 32) over 40 layers:
# dense 0-2, then MoE every other layer (3, 5, ...) but layer 9; the MTP block (40) is dense.
LONG = {"model.n_layers": "40", "moe.first_k_dense": "3", "moe.moe_every": "2", "moe.dense_layers": "[9]"}
ROWWISE, BLOCKWISE = {"precision.fp8": "rowwise"}, {"precision.fp8": "blockwise"}


def _exclude(*patterns: str) -> dict:
    return {"precision.fp8_exclude": "[" + ", ".join(f'"{p}"' for p in patterns) + "]"}


# name: (preset, overrides, compute dtype, the error the whole model gives: a piece of it, or None)
CASES = {
    "tensorwise": ("tiny-deepseek", {**LONG, "precision.fp8": "tensorwise"}, BF16, None),
    "rowwise": ("tiny-deepseek", {**LONG, **ROWWISE}, BF16, None),
    "blockwise: experts misaligned": ("tiny-deepseek", {**LONG, **BLOCKWISE}, BF16, "multiples of 128"),
    "blockwise, experts excluded": ("tiny-deepseek", {**LONG, **BLOCKWISE, **_exclude("*.experts")}, BF16, None),
    "blockwise, main experts excluded by number": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "model.mtp_layers": "0",
                          **_exclude(*(f"layers.{i}.ffn.experts" for i in range(3, 40, 2) if i != 9))}, BF16, None),
    "blockwise, one MoE layer left": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "model.mtp_layers": "0",
                          **_exclude(*(f"layers.{i}.ffn.experts" for i in range(3, 37, 2) if i != 9))},
        BF16, "multiples of 128"),
    "blockwise, MoE MTP block not excluded": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "moe.dense_layers": "[]", "model.n_layers": "41",
                          **_exclude("layers.*.ffn.experts")}, BF16, "multiples of 128"),
    "blockwise, MoE MTP block excluded by number": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "model.n_layers": "41",
                          **_exclude("layers.*.ffn.experts", "mtp.layers.0.block.ffn.experts")}, BF16, None),
    "blockwise, bf16 first and last": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "model.n_layers": "12", "model.mtp_layers": "0",
                          "precision.fp8_bf16_first_layers": "5", "precision.fp8_bf16_last_layers": "7"},
        BF16, None),
    "blockwise, bf16 first and last leave one": (
        "tiny-deepseek", {**LONG, **BLOCKWISE, "model.n_layers": "12", "model.mtp_layers": "0",
                          "precision.fp8_bf16_first_layers": "5", "precision.fp8_bf16_last_layers": "6"},
        BF16, "multiples of 128"),
    "pinned MoE layer": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.7.ffn.experts", "layers.30.*")},
                         BF16, None),
    "pinned dense layer's experts: no module": (
        "tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.8.ffn.experts")}, BF16, "'layers.8.ffn.experts'"),
    "pinned listed dense layer's experts: no module": (
        "tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.7.*", "layers.9.ffn.experts")}, BF16,
        "'layers.9.ffn.experts'"),
    "second pattern matches nothing": (
        "tiny-deepseek", {**LONG, **ROWWISE, **_exclude("*.attn.wq_a", "layers.38.ffn.experts", "*.nothing")},
        BF16, "'layers.38.ffn.experts'"),
    "pinned beyond the stack": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.40.*")}, BF16, "'layers.40.*'"),
    "pinned far beyond the stack": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.99")}, BF16, "'layers.99'"),
    "pinned with a leading zero": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.07.attn")}, BF16,
                                   "'layers.07.attn'"),
    "pinned layer, whole": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.39")}, BF16, None),
    "pinned MTP module": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("mtp.layers.0.eh_proj", "mtp.layers.0")},
                          BF16, None),
    "pinned MTP module that is not": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("mtp.layers.1.*")}, BF16,
                                      "'mtp.layers.1.*'"),
    "pinned MTP block's experts, dense": (
        "tiny-deepseek", {**LONG, **ROWWISE, **_exclude("mtp.layers.0.block.ffn.experts")}, BF16,
        "'mtp.layers.0.block.ffn.experts'"),
    "pinned main layer numbered as the MTP block": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.40")},
                                                    BF16, "'layers.40'"),
    "digit-dependent pattern": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.1*.ffn.experts")},
                                BF16, None),
    "digit-dependent pattern, no module": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.?.ffn.experts",
                                                                                         "*4.attn")}, BF16, None),
    "digit-dependent pattern matching nothing": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("layers.4?.ffn")},
                                                 BF16, "'layers.4?.ffn'"),
    "pattern matching nothing": ("tiny-deepseek", {**LONG, **ROWWISE, **_exclude("*.ffn.w9")}, BF16, "'*.ffn.w9'"),
    "pattern matching no MTP": ("tiny-deepseek", {**LONG, **ROWWISE, "model.mtp_layers": "0", **_exclude("mtp*")},
                                BF16, "'mtp*'"),
    "weight cache": ("tiny-deepseek", {**LONG, **ROWWISE, "precision.fp8_weight_cache": "true"}, BF16, None),
    "weight cache, experts excluded": (
        "tiny-deepseek", {**LONG, **ROWWISE, "precision.fp8_weight_cache": "true", **_exclude("*.experts")},
        BF16, "does nothing here"),
    "weight cache, bf16 first and last": (
        "tiny-deepseek", {**LONG, **ROWWISE, "model.n_layers": "12", "model.mtp_layers": "0",
                          "precision.fp8_weight_cache": "true", "precision.fp8_bf16_first_layers": "5",
                          "precision.fp8_bf16_last_layers": "7"}, BF16, "does nothing here"),
    "weight cache, bf16 first and last, MoE MTP block": (
        "tiny-deepseek", {**LONG, **ROWWISE, "model.n_layers": "11", "moe.dense_layers": "[]",
                          "precision.fp8_weight_cache": "true", "precision.fp8_bf16_first_layers": "5",
                          "precision.fp8_bf16_last_layers": "6"}, BF16, None),
    "recompute and offload": ("tiny-deepseek", {**LONG, **ROWWISE, "memory.recompute": '["moe_act", "norm"]',
                                                "memory.offload": '["attn_core"]'}, BF16, None),
    "dense model": ("tiny-deepseek", {**LONG, **ROWWISE, "moe.num_experts": "0"}, BF16, None),
    "misaligned dim": ("tiny", {**ROWWISE, "model.n_layers": "30", "model.dim": "136", "model.head_dim": "32"},
                       BF16, "model.dim (136)"),
    "misaligned experts' hidden": ("tiny", {**ROWWISE, "model.n_layers": "30", "moe.expert_hidden": "200"},
                                   BF16, "moe.expert_hidden (200)"),
    "misaligned experts' hidden, fp32": ("tiny", {**ROWWISE, "model.n_layers": "30", "moe.expert_hidden": "200"},
                                         FP32, "moe.expert_hidden (200)"),
    "etp 2 slice misaligned": ("tiny", {**ROWWISE, "model.n_layers": "30", "moe.expert_hidden": "272",
                                        "parallel.etp": "2"}, BF16, "272 / 2"),
    "etp 2 slice aligned": ("tiny", {**ROWWISE, "model.n_layers": "30", "moe.expert_hidden": "288",
                                     "parallel.etp": "2"}, BF16, None),
    "blockwise etp 2": ("tiny", {**BLOCKWISE, "model.n_layers": "30", "parallel.etp": "2", "moe.expert_hidden": "384"},
                        BF16, "384 / 2"),
    "tp 2 unaligned linears stay bf16": ("tiny", {**ROWWISE, "model.n_layers": "30", "parallel.tp": "2",
                                                  "model.ffn_hidden": "48"}, BF16, None),
    "qwen3 rowwise, pinned last layer": ("qwen3-moe-300m", {**ROWWISE, "model.n_layers": "30",
                                                            **_exclude("layers.29.attn.*")}, BF16, None),
    "grouped_mm misaligned": ("tiny", {"moe.experts_backend": "grouped_mm", "model.n_layers": "30",
                                       "moe.expert_hidden": "260"}, BF16, "experts_backend=grouped_mm"),
    "grouped_mm misaligned fp32": ("tiny", {"moe.experts_backend": "grouped_mm", "model.n_layers": "30",
                                            "moe.expert_hidden": "258"}, FP32, "experts_backend=grouped_mm"),
    "grouped_mm aligned fp32, not bf16": ("tiny", {"moe.experts_backend": "grouped_mm", "model.n_layers": "30",
                                                   "moe.expert_hidden": "260"}, FP32, None),
    "grouped_mm etp 2 slice misaligned": ("tiny", {"moe.experts_backend": "grouped_mm", "model.n_layers": "30",
                                                   "parallel.etp": "2", "moe.expert_hidden": "264"}, BF16,
                                          "264 / 2"),
    "grouped_mm with fp8": ("tiny-deepseek", {**LONG, **ROWWISE, "moe.experts_backend": "grouped_mm"}, BF16, None),
}


def _whole_model_refusal(cfg, vocab_size: int, compute_dtype: torch.dtype) -> None:
    """What refuse.py did before: the whole model built on the meta device and converted to FP8."""
    with torch.device("meta"), tensor_sizes():
        model = build_model(cfg, vocab_size, "cpu", compute_dtype)
    apply_fp8(model, cfg.precision, "cpu", compute_dtype=compute_dtype,
              sequence_parallel=cfg.parallel.shards_sequence, tp=cfg.parallel.tp, etp=cfg.parallel.etp)


def _error_of(check, *args) -> str | None:
    try:
        check(*args)
    except ConfigError as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("case", CASES)
def test_refuses_as_the_whole_model(case):
    preset, overrides, dtype, piece = CASES[case]
    cfg = load_config(preset, overrides)
    want = _error_of(_whole_model_refusal, cfg, VOCAB, dtype)
    # the case tests what its name says: the whole model's error is the one recorded
    assert (want is None) if piece is None else (piece in (want or "")), want
    assert _error_of(refuse_unbuildable, cfg, VOCAB, dtype, None) == want


def _seconds_to_refuse(cfg, budget_s: float) -> float:
    """refuse_unbuildable's time, failing once it runs past `budget_s` (the whole-model build took
    ~5 ms a layer: hours for 10^6 layers)."""
    def out_of_time(*_):
        raise TimeoutError(f"refuse_unbuildable ran past {budget_s:.1f} s")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        start = time.perf_counter()
        refuse_unbuildable(cfg, VOCAB, BF16, None)
        return time.perf_counter() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("overrides", [
    {**ROWWISE, "moe.first_k_dense": "3", "moe.moe_every": "2"},
    {**ROWWISE, "precision.fp8_bf16_first_layers": "2", "precision.fp8_bf16_last_layers": "3",
     **_exclude("layers.5.*", "*.attn.wq_a")},
    {"moe.experts_backend": "grouped_mm", "moe.moe_every": "3"},
], ids=["fp8 moe_every", "fp8 first/last exclude", "grouped_mm"])
def test_cost_does_not_grow_with_the_layers(overrides):
    small = load_config("tiny-deepseek", {**overrides, "model.n_layers": "8"})
    huge = load_config("tiny-deepseek", {**overrides, "model.n_layers": str(10**6)})
    refuse_unbuildable(small, VOCAB, BF16, None)  # imports and first-call caches outside the timing
    small_s = min(_seconds_to_refuse(small, 60.0) for _ in range(3))
    assert _seconds_to_refuse(huge, 5 * small_s + 0.5) < 5 * small_s + 0.5
