"""memory.recompute at its edges, each found by training with the option against the same model
without it: under train.compile."""

import functools

import pytest
import torch
from memory_runs import (
    build,
    one_thread,  # noqa: F401 (autouse fixture)
    plain_run,
    train,
)

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.train.compile import compile_blocks


def _assert_close(run, ref) -> None:
    """Within fp32 rounding: a compiled graph sums in its own order."""
    torch.testing.assert_close(torch.stack(run.losses), torch.stack(ref.losses), rtol=1e-6, atol=0)
    for g, g_ref in zip(run.grads, ref.grads, strict=True):
        assert g.keys() == g_ref.keys()
        for name in g:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("config,names", [("qwen3", '["attn_core"]'),
                                          ("deepseek", '["shared_experts", "mlp"]'),
                                          ("deepseek", '["layer"]')])
def test_recomputed_sites_without_moe_layers_compile(config, names, monkeypatch):
    """A checkpointed site holding no MoE layer (the attention core, shared experts, a dense MLP or
    dense block) was given a context_fn of two nullcontexts, which torch.compile refuses ('must
    generate a tuple of two TorchDispatchModes'): train.compile with it failed at the first step.
    Traced by AOTAutograd with the aot_eager backend (no C++ compiler)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    model = build(config, {"memory.recompute": names})
    compile_blocks(model)
    _assert_close(train(model), plain_run(config))


@pytest.mark.parametrize("preset,name", [("tiny-qwen3", "norm"), ("tiny-deepseek", "mla_up_proj")])
def test_output_discarding_under_compile_is_refused(preset, name):
    """The pre-norms' and MLA's up-projection's output discarding rebuilds in backward, eagerly,
    the tensors the producer's forward saved; compiled, that forward saved others (an RMSNorm 3,
    eager 6), and the first backward failed with 'the producer is not deterministic'."""
    overrides = {"train.compile": "true", "memory.recompute": f'["{name}"]'}
    with pytest.raises(ConfigError, match=rf"^memory.recompute=\['{name}'\] with train.compile=true: "
                                          f"{name} cannot recompute inside a compiled block"):
        load_config(preset, overrides)
    load_config(preset, {**overrides, "train.compile": "false"})
    load_config(preset, {**overrides, "memory.recompute": '["attn_core", "moe_act"]'})


@pytest.mark.parametrize("modified", [False, True])
def test_an_input_modified_in_place_before_the_recompute_is_refused_as_autograd_refuses_it(modified):
    """The plain graph saves `x` and refuses it once changed in place; the recompute keeps `x`
    instead, and used the changed values without a word."""
    from moefold.memory.recompute import _Run

    def producer(x):
        return torch.sin(x) * x

    def gradient(recomputed: bool) -> torch.Tensor:
        leaf = torch.linspace(-1, 1, 6, requires_grad=True)
        x = leaf * 2
        out = _Run(producer, (x,)).forward((x,)) if recomputed else producer(x)
        if modified:
            x.add_(1)
        out.sum().backward()
        return leaf.grad

    if not modified:
        assert torch.equal(gradient(recomputed=True), gradient(recomputed=False))
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gradient(recomputed=False)
    with pytest.raises(RuntimeError, match=r"input 0 of the recomputed .*producer was modified by an "
                                           r"inplace operation after its forward \(version 0, now 1\)"):
        gradient(recomputed=True)
