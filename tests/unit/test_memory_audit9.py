"""Audit of memory.recompute and memory.offload against the plain run (same tiny model, batches
and seed, both off), bit for bit in fp32 on the CPU, where the other memory tests do not go:
lists of recomputed and offloaded names together under every MoE option whose decisions, counts
or randomness a recompute could repeat (capacity drops, router jitter, every aux-loss kind, the
expert bias), the parameters and buffers after the optimizer steps, FP8 emulation with
precision.fp8_saved_activations and a weight cache refreshed each step, and forwards without
gradients or in evaluation mode between training forwards."""

import pytest
import torch
from memory_runs import (
    assert_identical,
    batches,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
    train,
)

from moefold.fp8.apply import apply_fp8
from moefold.fp8.weight_cache import refresh_weight_caches
from moefold.train.loss import build_objective

# Drops (the latest copies of an over-full expert), jitter (a global-RNG draw per router call) and
# every balancing loss (micro-batch, sequence, global-batch counts kept across micro-batches, z).
MOE_OPTIONS = {"moe.capacity_factor": "1.0", "moe.drop_policy": "position", "moe.input_jitter": "0.1",
               "moe.aux_loss_coeff": "0.01", "moe.seq_aux_loss_coeff": "0.01",
               "moe.global_aux_loss_coeff": "0.01", "moe.z_loss_coeff": "0.001"}
# (config, recompute, offload): fine-grained sites together, regions with sites offloaded inside
# and outside them. deepseek-like adds MLA, shared experts, a dense layer, MTP and the expert bias.
LISTS = [
    ("qwen3", ["norm", "attn_core", "moe_act"], ["moe"]),
    ("qwen3", ["layer"], ["moe_act"]),
    ("deepseek", ["norm", "mla_up_proj", "moe"], ["attn_core", "mlp"]),
    ("deepseek", ["attn_core", "shared_experts", "moe_act", "mlp"], ["layer"]),
    ("deepseek", ["layer"], ["norm"]),
    ("mixtral", ["moe"], ["norm", "attn_core"]),
    ("mixtral", ["norm", "moe_act"], ["layer"]),
]


def _memory(recompute: list[str], offload: list[str]) -> dict[str, str]:
    names = {"memory.recompute": str(recompute).replace("'", '"')}
    if offload:  # every saved storage moves: the tiny tensors are below the default threshold
        names |= {"memory.offload": str(offload).replace("'", '"'), "memory.offload_min_bytes": "0"}
    return names


def _trained(model, steps: int = 2):
    """train()'s run (losses, gradients, MoE state, routing, RNG) and the model's parameters and
    buffers (the expert bias, the MoE counters) after its optimizer steps."""
    run = train(model, steps=steps)
    after = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return run, after


def _assert_same_after(after: dict, after_ref: dict) -> None:
    assert after.keys() == after_ref.keys()
    differ = [n for n in after if not torch.equal(after[n], after_ref[n])]
    assert not differ, f"after the optimizer steps {differ} differ"


@pytest.mark.parametrize("config,recompute,offload", LISTS,
                         ids=[f"{c}-{'+'.join(r)}-off-{'+'.join(o)}" for c, r, o in LISTS])
def test_lists_of_names_train_bit_identically_under_every_moe_option(config, recompute, offload):
    run, after = _trained(build(config, {**MOE_OPTIONS, **_memory(recompute, offload)}))
    run_ref, after_ref = _trained(build(config, MOE_OPTIONS))
    assert any(state["dropped"] > 0 for layers in run_ref.moe for state in layers), "no copy was dropped"
    assert_identical(run, run_ref)
    _assert_same_after(after, after_ref)


FP8 = [
    ("qwen3", {"precision.fp8": "rowwise"}, ["norm", "moe"], []),
    ("qwen3", {"precision.fp8": "tensorwise"}, ["attn_core"], ["layer"]),
    ("deepseek", {"precision.fp8": "rowwise"}, ["layer"], []),
    ("deepseek", {"precision.fp8": "rowwise", "precision.fp8_weight_grad": "bf16"},
     ["norm", "mla_up_proj", "shared_experts"], ["moe"]),
    ("mixtral", {"precision.fp8": "tensorwise"}, ["moe"], ["norm", "attn_core"]),
]


def _fp8_model(config: str, overrides: dict[str, str]):
    """FP8 emulation with the GEMM inputs kept in FP8 for backward and the experts' FP8 weights
    cached, refreshed after each optimizer step as the trainer does."""
    fp8 = {**overrides, "precision.fp8_saved_activations": "true", "precision.fp8_weight_cache": "true"}
    model = build(config, {**MOE_OPTIONS, **fp8})
    assert apply_fp8(model, model.cfg.precision, "cpu", compute_dtype=torch.float32)
    refresh_weight_caches(model)
    on_step = model.on_optimizer_step

    def stepped():
        on_step()
        refresh_weight_caches(model)
    model.on_optimizer_step = stepped
    return model


@pytest.mark.parametrize("config,fp8,recompute,offload", FP8,
                         ids=[f"{c}-{f['precision.fp8']}-{'+'.join(r)}-off-{'+'.join(o)}" for c, f, r, o in FP8])
def test_fp8_saved_activations_and_weight_cache_train_bit_identically(config, fp8, recompute, offload):
    """A recompute must keep the same FP8 tiles as the forward (the saver is chosen by grad mode
    when the GEMM is called) and read the cached weights of that step; offload moves the FP8
    inputs and their scales (float8 and fp32 storages) and leaves the cache."""
    run, after = _trained(_fp8_model(config, {**fp8, **_memory(recompute, offload)}))
    run_ref, after_ref = _trained(_fp8_model(config, fp8))
    assert_identical(run, run_ref)
    _assert_same_after(after, after_ref)


def _between_training_forwards(model) -> list[torch.Tensor]:
    """A training micro-batch with a padding mask, then a train-mode forward without gradients
    (it records MoE statistics, as the plain model's does), then an evaluation forward with
    gradients and its backward (no jitter, no balancing), then a training micro-batch: every loss,
    gradient, MoE statistic and counter and the RNG state on the way."""
    objective, seen = build_objective(model), []
    first, no_grad, evaluated, last = batches(4)
    valid_BS = torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.7
    torch.manual_seed(0)

    def micro_batch(ids, valid=None):
        total, _ = objective(model, ids[:, :-1], ids[:, 1:], valid)
        total.backward()
        seen.extend([total.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
        model.zero_grad(set_to_none=True)

    micro_batch(first, valid_BS)
    with torch.no_grad():
        seen.append(model(no_grad[:, :-1]))
    model.eval()
    micro_batch(evaluated)
    with torch.no_grad():
        seen.append(model(evaluated[:, :-1]))
    model.train()
    micro_batch(last)
    for layer in model.moe_layers():
        seen += [layer.step_tokens_per_expert_E.clone(), layer.balancer.global_counts_E.clone(),
                 layer.balancer.global_tokens.clone(), *layer.stats.pop().values()]
    return [*seen, torch.get_rng_state()]


@pytest.mark.parametrize("config,recompute,offload", [
    ("qwen3", ["norm", "moe"], ["attn_core"]),
    ("deepseek", ["norm", "mla_up_proj", "moe_act", "shared_experts"], ["mlp"]),
    ("deepseek", ["layer"], []),
    ("mixtral", ["moe_act"], ["layer"]),
])
def test_forwards_without_gradients_or_in_evaluation_change_nothing(config, recompute, offload):
    seen = _between_training_forwards(build(config, {**MOE_OPTIONS, **_memory(recompute, offload)}))
    seen_ref = _between_training_forwards(build(config, MOE_OPTIONS))
    assert len(seen) == len(seen_ref)
    differ = [i for i, (a, b) in enumerate(zip(seen, seen_ref)) if not torch.equal(a, b)]
    assert not differ, f"entries {differ} differ"
