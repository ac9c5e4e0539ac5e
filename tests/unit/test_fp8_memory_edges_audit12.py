"""Edges of FP8 with 'moe_act' in memory.recompute / memory.offload that test_fp8_memory_audit12
leaves out, each against the same FP8 model without the memory option (emulated GEMMs on the CPU,
bit for bit) or, for the planner, the real model measured: experts kept in bf16 by fp8_exclude or
fp8_bf16_first_layers (they keep the wrappers build_model gave them), MTP blocks, moe_act offloaded
inside a recomputed 'layer' or an offloaded 'moe', the permutation that is not memory-efficient.

A dropped wrapper trains the same, so the runs also count the activation outputs the recompute
freed: one per MoE layer (MTP's included) and micro-batch."""

import gc
import weakref

import pytest
import torch
from memory_runs import SavedBytes, assert_identical, batches, build, train
from memory_runs import one_thread  # noqa: F401 (autouse fixture)
from test_fp8_memory_audit12 import assert_planned_as_measured

from moefold.fp8.apply import apply_fp8
from moefold.fp8.saved import SaveInput
from moefold.memory import recompute
from moefold.memory.sites import is_wrapped
from moefold.moe.experts import Fp8GroupedExperts
from moefold.moe.layer import MoELayer

STEPS, ACCUM = 2, 2
RECOMPUTED = {"memory.recompute": '["moe_act"]'}


def fp8_model(config: str, overrides: dict[str, str], h_kept_as_is: bool = False):
    """build()'s model, converted as the trainer converts it (apply_fp8 after build_model).
    `h_kept_as_is`: the FP8 experts' down GEMM keeps the activation's output h as it is, as it
    does where moe_act is recomputed (the reference of an FP8-kept run: its weight gradient reads
    h, not h's FP8 copy)."""
    model = build(config, {"precision.fp8": "rowwise", **overrides})
    apply_fp8(model, model.cfg.precision, "cpu", compute_dtype=torch.float32)
    for layer in _moe_layers(model):
        if h_kept_as_is and isinstance(layer.experts, Fp8GroupedExperts):
            layer.experts.down_saver = SaveInput()
    return model


@pytest.fixture
def discards(monkeypatch) -> list[int]:
    """How many producer outputs the recompute freed (moe_act's h here)."""
    count = [0]
    discard = recompute._Run.discard_until_backward_of

    def counting(self, consumer_out):
        count[0] += 1
        return discard(self, consumer_out)
    monkeypatch.setattr(recompute._Run, "discard_until_backward_of", counting)
    return count


def _moe_layers(model) -> list[MoELayer]:
    """Every MoE layer, the MTP blocks' too."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@pytest.mark.parametrize("config,overrides,fp8_experts", [
    # both experts in bf16: the original Experts keep build_model's pair
    ("qwen3", {"precision.fp8_exclude": '["*.experts"]'}, [False, False]),
    # layer 0 in bf16, layer 1 in FP8
    ("qwen3", {"precision.fp8_bf16_first_layers": "1"}, [False, True]),
    # DeepSeek: dense layer 0, MoE layer 1 and the MTP block's MoE layer; FP8-kept inputs
    ("deepseek", {"precision.fp8_saved_activations": "true"}, [True, True]),
    # the activation handed the [R] probabilities it ignores (moe_act's unread argument)
    ("qwen3", {"moe.memory_efficient_permute": "false", "precision.fp8_saved_activations": "true"}, [True, True]),
    # one scale over all rows (the experts' GEMMs scale rows: fp8/grouped.py)
    ("deepseek", {"precision.fp8": "tensorwise"}, [True, True]),
], ids=["exclude-experts", "bf16-first-layer", "deepseek-mtp-kept", "no-mem-efficient-permute", "tensorwise"])
def test_recomputed_moe_act_trains_like_fp8_and_frees_h_in_every_moe_layer(config, overrides, fp8_experts,
                                                                           discards):
    model = fp8_model(config, {**overrides, **RECOMPUTED})
    layers = _moe_layers(model)
    assert [isinstance(layer.experts, Fp8GroupedExperts) for layer in layers] == fp8_experts
    assert all(is_wrapped(layer.experts, "_mm") and is_wrapped(layer.experts, "activation") for layer in layers)
    run = train(model, STEPS, ACCUM)
    assert discards[0] == STEPS * ACCUM * len(layers), "h was not freed in every MoE layer"
    assert_identical(run, train(fp8_model(config, overrides, h_kept_as_is=True), STEPS, ACCUM))


def test_weight_cache_with_grad_accumulation_and_recomputed_moe_act(discards):
    """precision.fp8_weight_cache quantizes the experts' weights once a step (refreshed after each
    optimizer step, as the Trainer does); the recomputed activation never calls the down GEMM
    again, so the cache's weights are read as often as without the recompute."""
    from moefold.fp8.weight_cache import refresh_weight_caches

    cache = {"precision.fp8_weight_cache": "true"}
    runs = []
    for overrides in ({**cache, **RECOMPUTED}, cache):
        model = fp8_model("qwen3", overrides)
        refresh_weight_caches(model)
        step = model.on_optimizer_step

        def refreshing(model=model, step=step):
            step()
            refresh_weight_caches(model)
        model.on_optimizer_step = refreshing
        runs.append(train(model, STEPS, ACCUM))
    assert discards[0] == STEPS * ACCUM * 2
    assert_identical(*runs)


@pytest.mark.parametrize("memory", [
    {"memory.recompute": '["layer"]', "memory.offload": '["moe_act"]'},
    {"memory.offload": '["moe", "moe_act"]'},
    {"memory.recompute": '["moe_act"]', "memory.offload": '["moe"]'},
    {"memory.recompute": '["moe"]', "memory.offload": '["moe_act"]'},
], ids=["offload-in-recomputed-layer", "offload-in-offloaded-moe", "recompute-in-offloaded-moe",
        "offload-in-recomputed-moe"])
def test_nested_moe_act_trains_like_fp8_with_the_outer_option_alone(memory):
    """moe_act inside a recomputed 'layer' or offloaded 'moe': the same as FP8 with the outer
    option alone, bit for bit, and an offload moves bytes."""
    outer = {k: v.replace(', "moe_act"]', "]") for k, v in memory.items() if v != '["moe_act"]'}
    both, alone = ({**m, "memory.offload_min_bytes": "0"} if "memory.offload" in m else m for m in (memory, outer))
    model = fp8_model("qwen3", both)
    assert_identical(train(model, STEPS, ACCUM), train(fp8_model("qwen3", alone), STEPS, ACCUM))
    if "memory.offload" in memory:
        assert model.activation_offload.offloaded_bytes > 0


def test_offloaded_moe_act_under_a_recomputed_layer_keeps_what_the_recomputed_layer_keeps(monkeypatch):
    """A recomputed layer keeps only its input: the offload inside it adds nothing to keep."""
    ids = batches(1)[0]
    nested = fp8_model("qwen3", {"memory.recompute": '["layer"]', "memory.offload": '["moe_act"]',
                                 "memory.offload_min_bytes": "0"})
    layer_only = fp8_model("qwen3", {"memory.recompute": '["layer"]'})
    assert SavedBytes(nested, monkeypatch).of_forward(nested, ids) == \
        SavedBytes(layer_only, monkeypatch).of_forward(layer_only, ids)


# The planner against the wrapped FP8 model, measured, to the byte (test_plan_memory's cases).
ALIGNED = {"model.dim": 128, "moe.expert_hidden": 128, "model.ffn_hidden": 128}
KEPT = {**ALIGNED, "precision.fp8": "rowwise", "precision.fp8_saved_activations": True}
PLAN_CASES = {
    "exclude-experts": ("tiny-qwen3", {**KEPT, "precision.fp8_exclude": '["*.experts"]', **RECOMPUTED}, "bf16"),
    "bf16-first-layer": ("tiny-qwen3", {**KEPT, "precision.fp8_bf16_first_layers": 1, **RECOMPUTED}, "bf16"),
    # DeepSeek's main MoE layer in bf16, its MTP block's in FP8
    "deepseek-bf16-main": ("tiny-deepseek", {**KEPT, "precision.fp8_bf16_first_layers": 2, **RECOMPUTED}, "fp32"),
    "deepseek-bf16-mtp": ("tiny-deepseek", {**KEPT, "precision.fp8_exclude": '["mtp.*"]', **RECOMPUTED}, "bf16"),
    "tensorwise-kept": ("tiny-qwen3", {**KEPT, "precision.fp8": "tensorwise", **RECOMPUTED}, "bf16"),
    "offload-in-recomputed-moe": ("tiny-deepseek", {**KEPT, "memory.recompute": '["moe"]',
                                                    "memory.offload": '["moe_act"]'}, "bf16"),
    "weight-cache": ("tiny-qwen3", {**KEPT, "precision.fp8_weight_cache": True, **RECOMPUTED}, "bf16"),
    "offload-in-recomputed-layer": ("tiny-qwen3", {**KEPT, "memory.recompute": '["layer"]',
                                                   "memory.offload": '["moe_act"]'}, "bf16"),
    "offload-in-offloaded-moe": ("tiny-qwen3", {**KEPT, "memory.offload": '["moe", "moe_act"]'}, "bf16"),
    "offload-no-mem-efficient-permute": ("tiny-deepseek", {**KEPT, "moe.memory_efficient_permute": False,
                                                           "memory.offload": '["moe_act"]'}, "bf16"),
}


@pytest.mark.parametrize("preset,overrides,dtype", PLAN_CASES.values(), ids=PLAN_CASES)
def test_the_planner_counts_the_edges_of_fp8_with_moe_act(preset, overrides, dtype):
    assert_planned_as_measured(preset, overrides, dtype)


def test_with_fp8_kept_inputs_only_the_down_weights_gradient_differs_from_the_plain_kept_run():
    """docs/fp8.md: under precision.fp8_saved_activations the recomputed down GEMM keeps h as it
    is, so its weight gradient reads h where the plain FP8-kept run reads h's FP8 copy (rounded
    once, not twice). Every other first-step gradient and the first step's losses are the plain
    kept run's, bit for bit; the down weights' gradients differ by FP8 noise (measured 3%), and
    the later losses with them (qwen3: 5e-5 relative)."""
    kept = {"precision.fp8_saved_activations": "true"}
    run = train(fp8_model("qwen3", {**kept, **RECOMPUTED}), STEPS, ACCUM)
    ref = train(fp8_model("qwen3", kept), STEPS, ACCUM)
    assert all(torch.equal(a, b) for a, b in zip(run.losses[:ACCUM], ref.losses[:ACCUM]))
    grads, grads_ref = run.grads[0], ref.grads[0]
    differ = sorted(n for n in grads if not torch.equal(grads[n], grads_ref[n]))
    assert differ == [f"layers.{i}.ffn.experts.w2_EFD" for i in range(2)]
    for name in differ:
        assert ((grads[name] - grads_ref[name]).norm() / grads_ref[name].norm()).item() < 0.1


@pytest.mark.parametrize("memory", [RECOMPUTED, {"memory.offload": '["moe_act"]', "memory.offload_min_bytes": "0"}],
                         ids=["recomputed", "offloaded"])
def test_the_replaced_experts_are_freed_and_the_offload_keeps_the_fp8_experts_buffers(memory):
    """apply_fp8's swap leaves nothing holding the bf16 experts it replaced: the offload region
    carried over keeps the FP8 experts' buffers on the device (the weight cache's), not the old
    module's. Held, the old module kept its parameters alive: after parallelize's EP slicing, the
    whole [E, D, F] weights beside the rank's slice."""
    model = build("qwen3", {"precision.fp8": "rowwise", "precision.fp8_weight_cache": "true", **memory})
    replaced = [weakref.ref(layer.experts) for layer in model.moe_layers()]
    apply_fp8(model, model.cfg.precision, "cpu", compute_dtype=torch.float32)
    gc.collect()
    assert [ref() for ref in replaced] == [None] * len(replaced)


def test_the_offloaded_activation_keeps_the_fp8_experts_buffers_on_the_device(monkeypatch):
    """The offload region carried over to the FP8 experts leaves their buffers (the weight
    cache's FP8 weights) on the device, as the region does for the module it was built on."""
    from moefold.fp8.weight_cache import refresh_weight_caches
    from moefold.memory.offload import ActivationOffload

    model = fp8_model("qwen3", {"precision.fp8_weight_cache": "true", "memory.offload": '["moe_act"]',
                                "memory.offload_min_bytes": "0"})
    refresh_weight_caches(model)
    kept_on_device: list[set[int]] = []
    pack = ActivationOffload.pack

    def recording(self, t):
        kept_on_device.append(set(self._buffers))
        return pack(self, t)
    monkeypatch.setattr(ActivationOffload, "pack", recording)
    ids = batches(1)[0]
    model(ids[:, :-1])
    buffers = {b.untyped_storage()._cdata for layer in model.moe_layers() for b in layer.experts.buffers()}
    assert buffers and kept_on_device
    assert all(buffers & region for region in kept_on_device)
