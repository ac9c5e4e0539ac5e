"""memory.recompute / memory.offload against the plain model, bit for bit, where the other test
files do not go: a retained graph's second backward."""

import pytest
import torch
from memory_runs import (
    MODULES,
    batches,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
)

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
