"""The global gradient norm (GradNormClipper) against a naive reference: the fp64 norm of all
gradients, and torch.nn.utils.clip_grad_norm_'s coefficient, for fp32 and bf16 gradients (bf16
masters' and parameters'). The sharded layouts against one process: tests/distributed."""

import pytest
import torch

from moefold.parallel.data import GradNormClipper

SHAPES = [(4096, 64), (512,), (64, 64, 4)]


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
    for p in params:  # rows of very different sizes, as real gradients have
        p.grad = (torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], *[1] * (p.dim() - 1),
                                                                   generator=gen).mul(8).exp2()).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_the_fp64_norm_of_the_gradients(dtype):
    """Each tensor's norm is taken in fp32: bf16 gradients' norms were rounded to bf16 each (880.0
    for a tensor of norm 881.22; here 0.22% off), and a layout's pieces rounded otherwise than the
    whole tensors. (fp32's own sums of 262,144 squares: 1.5e-5.)"""
    params = _params(dtype)
    want = torch.cat([p.grad.double().reshape(-1) for p in params]).norm()
    norm = GradNormClipper(params)(float("inf"))
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_scales_every_gradient_to_the_max_norm(dtype):
    params = _params(dtype)
    before = [p.grad.double() for p in params]
    total = torch.cat([g.reshape(-1) for g in before]).norm()
    max_norm = total.item() / 10
    GradNormClipper(params)(max_norm)
    for p, g in zip(params, before):  # the clip coefficient max_norm / (norm + 1e-6), as torch's
        want = (g * (max_norm / (total + 1e-6))).to(dtype)
        # bf16: the product by the coefficient rounded to bf16 (one ulp, docs/optimizer.md)
        torch.testing.assert_close(p.grad, want, rtol=1e-4 if dtype == torch.float32 else 2 ** -7, atol=0)
