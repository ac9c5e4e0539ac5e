"""Expert activations × routing probabilities (`ProbsInActivation`): the written-out backward equals
autograd through the plain expression bit for bit (same ops, same roundings) and an fp64 reference
within rounding, for every activation, in fp32 and bf16; and torch.compile traces it whole (no
graph break, so Inductor fuses it with its neighbours)."""

import pytest
import torch

from moefold.moe.activation import ACTIVATIONS, ProbsInActivation


def _inputs(num_inputs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    probs_R = torch.rand(64, generator=gen).requires_grad_()
    inputs = [(3 * torch.randn(64, 48, generator=gen)).to(dtype).requires_grad_() for _ in range(num_inputs)]
    return probs_R, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_probs_in_activation_backward_matches_autograd(name, dtype):
    act = ACTIVATIONS[name]
    probs_R, inputs = _inputs(act.num_inputs, dtype)
    grad_RF = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = ProbsInActivation(act)(probs_R, *inputs)
    got = torch.autograd.grad(out, [probs_R, *inputs], grad_RF)
    # reference: autograd through the expression, in fp64
    leaves = [t.detach().double().requires_grad_() for t in (probs_R, *inputs)]
    ref_out = act.fn(*leaves[1:]) * leaves[0][:, None]
    want = torch.autograd.grad(ref_out, leaves, grad_RF.double())
    for g, w in zip((out, *got), (ref_out, *want)):
        assert g.dtype == (torch.float32 if g.shape == probs_R.shape else dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
        else:  # bf16 rounding of the recomputed output and of the results: ~2^-8 relative overall
            assert ((g.double() - w).norm() / w.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_probs_in_activation_is_bit_identical_to_autograd(name, dtype):
    act = ACTIVATIONS[name]
    probs_R, inputs = _inputs(act.num_inputs, dtype, seed=3)
    grad_RF = torch.randn(64, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = torch.autograd.grad(ProbsInActivation(act)(probs_R, *inputs), [probs_R, *inputs], grad_RF)
    out_RF = act.fn(*inputs)
    want = torch.autograd.grad((out_RF.float() * probs_R[:, None]).to(dtype), [probs_R, *inputs], grad_RF)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_only_requested_gradients_are_computed():
    act = ACTIVATIONS["swiglu"]
    probs_R, inputs = _inputs(2, torch.float32)
    probs_R = probs_R.detach()
    out = ProbsInActivation(act)(probs_R, *inputs)
    out.sum().backward()
    assert probs_R.grad is None and all(t.grad is not None for t in inputs)


def test_compile_traces_the_activation_without_a_graph_break():
    act = ProbsInActivation(ACTIVATIONS["swiglu"])
    probs_R, inputs = _inputs(2, torch.float32)
    explained = torch._dynamo.explain(lambda p, g, u: act(p, g, u).sum())(probs_R, *inputs)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_compiled_gradients_equal_eager(name, dtype):
    """Under torch.compile the Function's inputs get the eager gradients. torch 2.11 gave them zeros
    when forward returned a no-op `.to(dtype)` of its product (fp32: pytorch#180642); aot_eager runs
    the same Dynamo and AOTAutograd tracing without a C++ compiler."""
    act = ProbsInActivation(ACTIVATIONS[name])
    probs_R, inputs = _inputs(act.num_inputs, dtype)
    grad_RF = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    eager = torch.autograd.grad(act(probs_R, *inputs), [probs_R, *inputs], grad_RF)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, *xs: act(p, *xs), backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(probs_R, *inputs), [probs_R, *inputs], grad_RF)
    for g, e in zip(got, eager):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, e, rtol=0, atol=0)
