"""memory.recompute / memory.offload against the plain model, bit for bit, where the other test
files do not go: a retained graph's second backward, the FP8 weight cache under offload."""

import pytest
import torch
from memory_runs import (
    MODULES,
    batches,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
)

from moefold.config import load_config
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
    wrapped = _two_backwards(build("deepseek", {f"memory.{key}": f'["{name}"]', "memory.offload_min_bytes": "0"}))
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
    from moefold.fp8.apply import apply_fp8
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
