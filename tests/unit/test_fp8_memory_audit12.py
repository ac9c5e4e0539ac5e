"""FP8 with 'moe_act' in memory.recompute / memory.offload: apply_fp8 puts FP8 experts in the
place of experts the memory options wrapped when the model was built, and carries the wrappers
over (memory/sites.rewrap). Each run is compared, bit for bit, with the same FP8 model without
the memory option (the emulated GEMMs on the CPU): a dropped wrapper trains the same but keeps
more, so the saved bytes are checked too."""

import pytest
import torch
from memory_runs import (FP8_RECIPES, SavedBytes, assert_identical, batches, fp8_model,
                         rowwise_fp8_h_bytes, train)
from memory_runs import one_thread  # noqa: F401 (autouse fixture)

from moefold.config import load_config
from moefold.fp8.saved import SaveInput
from moefold.memory.recompute import DiscardedOutput
from moefold.memory.sites import Site


def test_the_config_takes_fp8_with_moe_act_recomputed_or_offloaded():
    for key in ("recompute", "offload"):
        cfg = load_config("tiny-qwen3", {"precision.fp8": "rowwise", f"memory.{key}": '["moe_act"]'})
        assert cfg.memory.__dict__[key] == ["moe_act"]


@pytest.mark.parametrize("config", ["qwen3", "deepseek"])
@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
def test_fp8_with_moe_act_recomputed_trains_bit_identically(config, recipe):
    run = train(fp8_model(config, recipe, {"memory.recompute": '["moe_act"]'}))
    assert_identical(run, train(fp8_model(config, recipe)))


@pytest.mark.parametrize("config", ["qwen3", "mixtral"])
def test_fp8_with_moe_act_offloaded_trains_bit_identically_and_offloads(config):
    model = fp8_model(config, "rowwise", {"memory.offload": '["moe_act"]', "memory.offload_min_bytes": "0"})
    run = train(model)
    assert_identical(run, train(fp8_model(config, "rowwise")))
    assert model.activation_offload.offloaded_bytes > 0


def test_the_recomputed_activation_output_is_freed_under_fp8(monkeypatch):
    """The activation's output h, which the down GEMM keeps as it is (fp32 here), is freed once
    the GEMM ran: R·F·4 bytes a layer fewer than the plain FP8 run (gate and up: kept by both)."""
    ids = batches(1)[0]
    plain, recomputed = fp8_model("qwen3", "rowwise"), fp8_model("qwen3", "rowwise",
                                                                {"memory.recompute": '["moe_act"]'})
    freed = SavedBytes(plain, monkeypatch).of_forward(plain, ids) - \
        SavedBytes(recomputed, monkeypatch).of_forward(recomputed, ids)
    T = ids.shape[0] * (ids.shape[1] - 1)
    assert freed == sum(layer.dispatcher.layout.num_rows(T * layer.top_k) * layer.experts.w2_EFD.shape[1] * 4
                        for layer in recomputed.moe_layers())


def test_with_fp8_kept_inputs_the_recomputed_output_is_not_kept_in_fp8(monkeypatch):
    """precision.fp8_saved_activations keeps the GEMMs' inputs in FP8; the down GEMM's input h,
    freed and recomputed, is kept as it is instead (an FP8 copy would outlive it): the run equals
    the plain FP8-kept run whose down GEMM keeps h as it is, and keeps h's FP8 copy (1 byte an
    element and a row's scale) fewer bytes than the plain FP8-kept run."""
    kept = {"precision.fp8_saved_activations": "true"}
    recomputed = fp8_model("qwen3", "rowwise", {**kept, "memory.recompute": '["moe_act"]'})
    assert all(type(layer.experts.down_saver) is SaveInput for layer in recomputed.moe_layers())
    ids = batches(1)[0]
    plain = fp8_model("qwen3", "rowwise", kept)
    freed = SavedBytes(plain, monkeypatch).of_forward(plain, ids) - \
        SavedBytes(recomputed, monkeypatch).of_forward(recomputed, ids)
    assert freed == rowwise_fp8_h_bytes(plain, ids)
    reference = fp8_model("qwen3", "rowwise", kept)
    for layer in reference.moe_layers():
        layer.experts.down_saver = SaveInput()
    assert_identical(train(fp8_model("qwen3", "rowwise", {**kept, "memory.recompute": '["moe_act"]'})),
                     train(reference))


def test_the_carried_pair_is_the_fp8_experts_own():
    """After the swap the DiscardedOutput pair wraps the FP8 experts' activation and down GEMM,
    each once (a second wrap would recompute twice), and the old experts are gone."""
    model = fp8_model("qwen3", "rowwise", {"memory.recompute": '["moe_act"]'})
    for layer in model.moe_layers():
        experts = layer.experts
        assert "_mm" in vars(experts)
        assert experts._mm.__qualname__.startswith(DiscardedOutput._consuming.__qualname__.rsplit(".", 1)[0])
        inner = experts.activation._inner
        assert not hasattr(inner, "_inner"), "the activation wrapped twice"
        assert Site(experts, "activation").modules() == []


def test_a_model_with_its_memory_wrappers_still_refuses_deep_copies():
    import copy

    model = fp8_model("qwen3", "rowwise", {"memory.recompute": '["moe_act"]'})
    with pytest.raises(TypeError, match="cannot deep-copy a model built with memory.recompute"):
        copy.deepcopy(model.moe_layers()[0].experts)


def test_eval_forward_under_no_grad_matches_the_plain_fp8_model():
    ids = batches(1)[0]
    plain, recomputed = fp8_model("qwen3", "rowwise"), fp8_model("qwen3", "rowwise",
                                                                {"memory.recompute": '["moe_act"]'})
    with torch.no_grad():
        assert torch.equal(plain(ids[:, :-1]), recomputed(ids[:, :-1]))


# The memory planner against the FP8 model with the wrappers carried over, to the byte, as
# test_plan_memory's recompute and offload cases (dims aligned to 128 for blockwise).
ALIGNED = {"model.dim": 128, "moe.expert_hidden": 128, "model.ffn_hidden": 128}
PLAN_CASES = [(preset, {**ALIGNED, "precision.fp8": recipe, "precision.fp8_saved_activations": kept,
                        f"memory.{kind}": '["moe_act"]'}, dtype)
              for preset, recipe in (("tiny-qwen3", "rowwise"), ("tiny-deepseek", "blockwise"))
              for kept in (False, True) for kind in ("recompute", "offload") for dtype in ("fp32", "bf16")] + [
    # without the memory-efficient permutation the activation keeps silu(gate) too
    ("tiny-deepseek", {**ALIGNED, "precision.fp8": "rowwise", "precision.fp8_saved_activations": True,
                       "moe.memory_efficient_permute": False, "memory.recompute": '["moe_act"]'}, "bf16"),
    # inside a recomputed or offloaded MoE layer
    ("tiny-qwen3", {**ALIGNED, "precision.fp8": "rowwise", "precision.fp8_saved_activations": True,
                    "memory.recompute": '["moe_act"]', "memory.offload": '["moe"]'}, "bf16"),
]


@pytest.mark.parametrize("preset,overrides,dtype", PLAN_CASES, ids=[f"{p}-{o}-{d}" for p, o, d in PLAN_CASES])
def test_the_planner_counts_fp8_with_moe_act_wrapped(preset, overrides, dtype):
    assert_planned_as_measured(preset, overrides, dtype)


def assert_planned_as_measured(preset: str, overrides: dict, dtype: str) -> None:
    """The planner's activations, by category and in all, and its host bytes equal the wrapped
    model's, measured (test_plan_memory's dtypes by name)."""
    from test_plan_memory import DTYPES, _case_config, _nonzero

    from moefold.plan import predict_memory
    from moefold.plan.measure import measure_saved_activations

    cfg = _case_config(preset, overrides, dtype)
    measured = measure_saved_activations(cfg, DTYPES[dtype][2], param_dtype=DTYPES[dtype][3])
    plan = predict_memory(cfg, 1)
    assert _nonzero(plan.activations) == _nonzero(measured.by_category)
    assert measured.total == plan.activation_total
    assert measured.host == plan.offloaded
