"""memory.recompute / memory.offload against the plain model, bit for bit, where the other test
files do not go: a retained graph's second backward, the FP8 weight cache under offload, the tiny
preset, FP8 emulation, bf16 autocast, padding masks and recompute with offload together."""

import contextlib

import pytest
import torch
from memory_runs import (
    MODULES,
    batches,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
)

from moefold.config import load_config
from moefold.fp8.apply import apply_fp8
from moefold.models.transformer import build_model
from moefold.train.loss import build_objective


def _two_backwards(model) -> list[dict[str, torch.Tensor]]:
    """The gradients of two backwards of one micro-batch's graph, the first retaining it."""
    ids = batches(1)[0]
    torch.manual_seed(0)  # the router's jitter draws from the global RNG
    total, _ = build_objective(model)(model, ids[:, :-1], ids[:, 1:])
    grads = []
    for retain in (True, False):
        total.backward(retain_graph=retain)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("key", ["recompute", "offload"])
@pytest.mark.parametrize("name", MODULES["deepseek"])
def test_a_retained_graph_backpropagates_twice_as_the_plain_one(key, name):
    """A second backward of a retained graph recomputes again (torch.utils.checkpoint) or finds
    what the first recomputed; it stopped with a TypeError ('NoneType' object is not iterable:
    an output-discarding site, norm, mla_up_proj, moe_act) or an AttributeError (moe, layer: the
    routing replay's context, a generator, entered twice)."""
    plain = _two_backwards(build("deepseek"))
    min_bytes = {"memory.offload_min_bytes": "0"} if key == "offload" else {}  # else refused
    wrapped = _two_backwards(build("deepseek", {f"memory.{key}": f'["{name}"]', **min_bytes}))
    for i, (grads, grads_ref) in enumerate(zip(wrapped, plain)):
        assert grads.keys() == grads_ref.keys()
        differ = [n for n in grads if not torch.equal(grads[n], grads_ref[n])]
        assert not differ, f"backward {i + 1}: gradients of {differ} differ"


@pytest.mark.parametrize("name", ["moe", "layer"])
def test_the_fp8_weight_cache_stays_on_the_device(name):
    """precision.fp8_weight_cache keeps the experts' FP8 weights in buffers for the whole run, and
    their GEMMs save them for backward; an offloaded `moe` or `layer` copied them to the host and
    back in every micro-batch as if they were activations (tiny-qwen3 at dim 64, fp32: 2,254,720 B
    of host copies, 786,432 B of them the cache, where the planner counts 1,468,288 B), moving
    nothing off the device. They stay, as parameters do, and the host copies are the planner's."""
    from moefold.fp8.weight_cache import refresh_weight_caches
    from moefold.plan.measure import measure_saved_activations
    from moefold.plan.memory import predict_memory

    fp8 = {"precision.fp8": "rowwise", "precision.fp8_weight_cache": "true"}
    model = build("qwen3", {**fp8, "memory.offload": f'["{name}"]', "memory.offload_min_bytes": "0"})
    apply_fp8(model, model.cfg.precision, "cpu", compute_dtype=torch.float32)
    refresh_weight_caches(model)
    cache = {b.untyped_storage()._cdata: n for n, b in model.named_buffers() if n.rpartition(".")[2].startswith("fp8_")}
    assert cache
    offload, pack, moved = model.activation_offload, model.activation_offload.pack, []

    def spying(t):
        packed = pack(t)
        if packed is not t:
            moved.append(cache.get(t.untyped_storage()._cdata))
        return packed
    offload.pack = spying
    ids = batches(1)[0]
    build_objective(model)(model, ids[:, :-1], ids[:, 1:])[0].backward()
    assert moved and not [n for n in moved if n is not None]

    cfg = load_config("tiny-qwen3", {"train.micro_batch_size": 2, "model.dim": 64, "moe.expert_hidden": 64,
                                     "precision.compute_dtype": "fp32", **fp8,
                                     "memory.offload": f'["{name}"]', "memory.offload_min_bytes": 4096})
    assert measure_saved_activations(cfg, "fp32").host == predict_memory(cfg, 1).offloaded


SMALL = {"model.dim": "32", "model.n_layers": "2", "train.seq_len": "16", "train.micro_batch_size": "2"}
FP8 = {"precision.fp8": "rowwise", "precision.fp8_emulate": "true"}
DROPS_AND_JITTER = {"moe.capacity_factor": "1.0", "moe.input_jitter": "0.1"}
# (preset, options, memory, autocast to bf16 over fp32 parameters, a padding mask)
MATRIX = [
    ("tiny", {}, {"recompute": '["norm", "mlp", "moe_act"]'}, False, False),
    ("tiny", DROPS_AND_JITTER, {"offload": '["layer"]'}, True, False),
    ("tiny-deepseek", {**FP8, **DROPS_AND_JITTER}, {"recompute": '["layer"]'}, False, True),
    ("tiny-deepseek", FP8, {"recompute": '["norm", "mla_up_proj"]', "offload": '["moe"]'}, True, False),
    ("tiny-qwen3", {"moe.global_aux_loss_coeff": "0.01"}, {"recompute": '["norm", "moe_act"]'}, True, True),
    ("tiny-mixtral", DROPS_AND_JITTER, {"recompute": '["moe"]', "offload": '["attn_core", "norm"]'}, True, False),
]


def _matrix_run(preset, options, memory, autocast, padded):
    """Two steps of two micro-batches as Trainer.train_step runs them: losses (and their parts),
    gradients, MoE statistics and counts, buffers after each step (the expert bias), routing, RNG."""
    min_bytes = {"memory.offload_min_bytes": "0"} if memory.get("offload") else {}  # else refused
    cfg = load_config(preset, {**SMALL, **options, **{f"memory.{k}": v for k, v in memory.items()}, **min_bytes})
    dtype = torch.bfloat16 if autocast else torch.float32
    model = build_model(cfg, 64, "cpu", dtype)
    model.init_weights(seed=0)
    apply_fp8(model, cfg.precision, "cpu", shared_inputs=not autocast, compute_dtype=dtype)
    model.train()
    for layer in model.moe_layers():
        layer.aux_loss_scale = 0.5
    objective, optimizer = build_objective(model), torch.optim.AdamW(model.parameters(), lr=1e-2)
    valid_BS = torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.7 if padded else None
    run = []
    torch.manual_seed(0)
    with model.router_replay.record():
        for i, ids in enumerate(batches(4)):
            with torch.autocast("cpu", dtype) if autocast else contextlib.nullcontext():
                total, parts = objective(model, ids[:, :-1], ids[:, 1:], valid_BS)
            (total / 2).backward()
            run.append({"total": total.detach(), **parts})
            if i % 2 == 1:  # the step's second micro-batch
                run.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                run += [{"step": m.step_tokens_per_expert_E.clone(), **m.stats.pop()} for m in model.moe_layers()]
                optimizer.step()
                model.on_optimizer_step()
                optimizer.zero_grad(set_to_none=True)
                run.append({n: b.clone() for n, b in model.named_buffers()})
    run.append({"routing": model.router_replay.recorded(), "rng": torch.get_rng_state()})
    return run


@pytest.mark.parametrize("preset,options,memory,autocast,padded", MATRIX,
                         ids=[f"{c[0]}-{'-'.join(c[2])}-{i}" for i, c in enumerate(MATRIX)])
def test_wrapped_models_train_bit_identically(preset, options, memory, autocast, padded):
    run, plain = (_matrix_run(preset, options, m, autocast, padded) for m in (memory, {}))
    assert len(run) == len(plain)
    for i, (part, part_ref) in enumerate(zip(run, plain)):
        assert part.keys() == part_ref.keys(), i
        differ = [k for k in part if not torch.equal(part[k], part_ref[k])]
        assert not differ, f"entry {i}: {differ} differ"

