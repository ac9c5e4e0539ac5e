"""memory.recompute / memory.offload applied from Python after apply_fp8 (TorchTitan's order:
convert to float8, then apply activation checkpointing) against the config's order (build_model
wraps the sites, then apply_fp8 carries the wrappers over to the FP8 experts): the same saved
tensors, to the byte, and the same training, bit for bit (emulated FP8 GEMMs on the CPU).

What the order could change: the FP8 experts' down GEMM keeps the activation's output h as it is
once moe_act's output discarding frees h after the GEMM ran (eager recompute); under
precision.fp8_saved_activations it would otherwise keep h's FP8 copy, which outlives the free
(R·F + 4·R bytes a layer more for rowwise)."""

import pytest
import torch
from memory_runs import (SavedBytes, assert_identical, batches, build, fp8_model, fp8_overrides,
                         rowwise_fp8_h_bytes, train)
from memory_runs import one_thread  # noqa: F401 (autouse fixture)

from moefold.fp8.apply import apply_fp8
from moefold.fp8.saved import SaveFp8Input, SaveInput
from moefold.memory import apply_offload, apply_recompute

KEPT = {"precision.fp8_saved_activations": "true"}
RECOMPUTED = {"memory.recompute": '["moe_act"]'}
OFFLOADED = {"memory.offload": '["moe_act"]', "memory.offload_min_bytes": "0"}
COMPILED = {"train.compile": "true"}  # moe_act's compiled form (a checkpoint over `_down`), run eagerly


def _fp8_overrides(recipe: str, overrides: dict[str, str]) -> dict[str, str]:
    return fp8_overrides(recipe, {**KEPT, **overrides})


def config_order(config: str, recipe: str, overrides: dict[str, str]):
    """The memory options in the config: build_model wraps, then apply_fp8 (the trainer's order)."""
    return fp8_model(config, recipe, {**KEPT, **overrides})


def python_order(config: str, recipe: str, recompute=(), offload=(), compiled: bool = False):
    """The FP8 model first, then apply_recompute / apply_offload from Python."""
    model = build(config, _fp8_overrides(recipe, COMPILED if compiled else {}))
    apply_fp8(model, model.cfg.precision, "cpu")
    apply_recompute(model, list(recompute), compiled=compiled)
    model.activation_offload = apply_offload(model, list(offload), 0, "cpu")
    return model


def _saved_bytes(model, monkeypatch) -> int:
    return SavedBytes(model, monkeypatch).of_forward(model, batches(1)[0])


@pytest.mark.parametrize("config,recipe", [("qwen3", "rowwise"), ("deepseek", "blockwise")])
def test_moe_act_recomputed_after_apply_fp8_keeps_and_trains_as_the_config_order(config, recipe, monkeypatch):
    configured = config_order(config, recipe, RECOMPUTED)
    later = python_order(config, recipe, recompute=["moe_act"])
    assert _saved_bytes(later, monkeypatch) == _saved_bytes(configured, monkeypatch)
    assert_identical(train(python_order(config, recipe, recompute=["moe_act"])),
                     train(config_order(config, recipe, RECOMPUTED)))


def test_the_fp8_copy_left_by_the_old_order_is_what_differed(monkeypatch):
    """The bytes the Python order kept more before the fix, computed from the shapes: h's FP8 copy
    (1 byte an element) and its row scales (fp32) in each MoE layer; so the equality above is not
    reached by two measures that see nothing."""
    ids = batches(1)[0]
    later = python_order("qwen3", "rowwise", recompute=["moe_act"])
    with_copy = python_order("qwen3", "rowwise", recompute=["moe_act"])
    for layer in with_copy.moe_layers():
        layer.experts.down_saver = layer.experts.saver  # the old order's choice
    assert all(type(layer.experts.saver) is SaveFp8Input for layer in with_copy.moe_layers())
    extra = SavedBytes(with_copy, monkeypatch).of_forward(with_copy, ids) - \
        SavedBytes(later, monkeypatch).of_forward(later, ids)
    assert extra == rowwise_fp8_h_bytes(later, ids)


def test_moe_act_offloaded_after_apply_fp8_keeps_offloads_and_trains_as_the_config_order(monkeypatch):
    """Offload wraps the activation only, whose region keeps the FP8 experts' buffers on the device
    (its owner): the same whichever came first."""
    configured = config_order("qwen3", "rowwise", OFFLOADED)
    later = python_order("qwen3", "rowwise", offload=["moe_act"])
    assert [type(layer.experts.down_saver) for layer in later.moe_layers()] == \
        [type(layer.experts.down_saver) for layer in configured.moe_layers()]
    assert _saved_bytes(later, monkeypatch) == _saved_bytes(configured, monkeypatch)
    assert later.activation_offload.offloaded_bytes == configured.activation_offload.offloaded_bytes > 0
    configured, later = config_order("qwen3", "rowwise", OFFLOADED), python_order("qwen3", "rowwise",
                                                                                   offload=["moe_act"])
    assert_identical(train(later), train(configured))
    assert later.activation_offload.offloaded_bytes == configured.activation_offload.offloaded_bytes


def test_the_compiled_form_after_apply_fp8_keeps_and_trains_as_the_config_order(monkeypatch):
    """train.compile's moe_act (a selective checkpoint over the activation and the down GEMM) wraps
    `_down`, not the GEMM: the down GEMM keeps its FP8 copy in either order (the checkpoint
    recomputes h only to quantize it again in backward). Run eagerly here: the same checkpoint."""
    configured = config_order("qwen3", "rowwise", {**COMPILED, **RECOMPUTED})
    later = python_order("qwen3", "rowwise", recompute=["moe_act"], compiled=True)
    assert all(type(layer.experts.down_saver) is SaveFp8Input for layer in later.moe_layers())
    assert all(type(layer.experts.down_saver) is SaveFp8Input for layer in configured.moe_layers())
    assert _saved_bytes(later, monkeypatch) == _saved_bytes(configured, monkeypatch)
    assert_identical(train(python_order("qwen3", "rowwise", recompute=["moe_act"], compiled=True)),
                     train(config_order("qwen3", "rowwise", {**COMPILED, **RECOMPUTED})))


def test_recompute_in_python_then_apply_fp8_is_the_config_order_too(monkeypatch):
    """apply_recompute on the bf16 model from Python, then apply_fp8: rewrap carries the pair over,
    and the FP8 experts switch as when build_model wrapped them."""
    model = build("qwen3", _fp8_overrides("rowwise", {}))
    apply_recompute(model, ["moe_act"])
    apply_fp8(model, model.cfg.precision, "cpu")
    assert all(type(layer.experts.down_saver) is SaveInput for layer in model.moe_layers())
    configured = config_order("qwen3", "rowwise", RECOMPUTED)
    assert _saved_bytes(model, monkeypatch) == _saved_bytes(configured, monkeypatch)


def test_eval_under_no_grad_is_unchanged_by_the_order():
    ids = batches(1)[0]
    later, plain = python_order("qwen3", "rowwise", recompute=["moe_act"]), python_order("qwen3", "rowwise")
    with torch.no_grad():
        assert torch.equal(later(ids[:, :-1]), plain(ids[:, :-1]))
