"""Gradient clipping inside torch's fused AdamW (`ClipInFusedAdamW`: the clip coefficient as the
kernel's gradient unscale factor) steps exactly like clipping in place and then stepping, and the
strategy is picked only where it applies; likewise PrecisionAwareAdamW's `grad_multiplier`
(`ClipInFusedPrecisionAdamW`), here on its CPU path (tests/gpu/test_fused_adamw_gpu.py runs its
kernel)."""

import pytest
import torch

from moefold.config import OptimConfig
from moefold.optim import precision
from moefold.optim.adamw import (
    ClipInFusedAdamW,
    ClipInFusedPrecisionAdamW,
    clip_scaling,
)
from moefold.optim.precision import PrecisionAwareAdamW
from moefold.parallel.data import GradNormClipper, scale_gradients


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 32), (32,), (8, 8))]


def _clip_and_step(reference, folded, clippers, optimizers, max_norm, gen) -> None:
    """The same random gradients on both parameter lists, clipped (the same norm), then a step."""
    grads = [3 * torch.randn(p.shape, generator=gen).to(p.dtype) for p in reference]
    for params in (reference, folded):
        for p, g in zip(params, grads):
            p.grad = g.clone()
    norms = [clip(max_norm) for clip in clippers]
    torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0)
    for opt in optimizers:
        opt.step()


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a coefficient of exactly 1
def test_clip_in_fused_adamw_steps_like_clipping_in_place(max_norm):
    reference, folded = _params(0), _params(0)
    opt_ref = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    opt_fold = torch.optim.AdamW(folded, lr=1e-2, weight_decay=0.1, fused=True)
    clip_ref = GradNormClipper(reference, scale=scale_gradients)
    clip_fold = GradNormClipper(folded, scale=ClipInFusedAdamW(opt_fold))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        _clip_and_step(reference, folded, (clip_ref, clip_fold), (opt_ref, opt_fold), max_norm, gen)
        for a, b in zip(reference, folded):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)  # left clipped too
    assert any((a - p).abs().max() > 1e-3 for a, p in zip(reference, _params(0)))  # it trained


def test_clip_scaling_picks_the_fused_kernel_only_where_it_applies():
    params = _params(0)
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    assert isinstance(clip_scaling(fused, OptimConfig()), ClipInFusedAdamW)
    # gradients rounded before the step (a pre-hook): clip them first
    assert clip_scaling(fused, OptimConfig(grad_dtype="bf16")) is scale_gradients
    foreach = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    assert clip_scaling(foreach, OptimConfig()) is scale_gradients


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """PrecisionAwareAdamW(fused=True) built without Triton or CUDA: its CPU groups take the
    foreach path, as they would on a GPU machine."""
    monkeypatch.setattr(precision, "triton_available", lambda: True)


def test_clip_scaling_picks_the_precision_adamw_kernel_only_when_fused(fused_on_cpu):
    fused = PrecisionAwareAdamW(_params(0), lr=1e-3, master="bf16+remainder", fused=True)
    assert isinstance(clip_scaling(fused, OptimConfig()), ClipInFusedPrecisionAdamW)
    assert isinstance(clip_scaling(fused, OptimConfig(grad_dtype="bf16")), ClipInFusedPrecisionAdamW)
    plain = PrecisionAwareAdamW(_params(0), lr=1e-3, master="bf16+remainder")
    assert clip_scaling(plain, OptimConfig()) is scale_gradients


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused-cpu-group"])
@pytest.mark.parametrize("moments", ["bf16", "fp8"])
@pytest.mark.parametrize("master", ["fp32", "bf16+remainder"])
def test_precision_adamw_grad_multiplier_steps_like_clipping_in_place(master, moments, fused, fused_on_cpu):
    """Off the kernel the multiplier scales the gradients in place (as scale_gradients) and is
    consumed by the step: the next step, unclipped, is not scaled."""
    reference, folded = _params(0), _params(0)
    hp = {"lr": 1e-2, "weight_decay": 0.1, "master": master, "exp_avg_dtype": moments}
    opt_ref = PrecisionAwareAdamW(reference, **hp)
    opt_fold = PrecisionAwareAdamW(folded, **hp, fused=fused)
    clip_ref = GradNormClipper(reference, scale=scale_gradients)
    clip_fold = GradNormClipper(folded, scale=ClipInFusedPrecisionAdamW(opt_fold))
    gen = torch.Generator().manual_seed(1)
    for max_norm in (0.5, 0.5, float("inf"), 0.5):  # the third step does not clip
        _clip_and_step(reference, folded, (clip_ref, clip_fold), (opt_ref, opt_fold), max_norm, gen)
        assert opt_fold.grad_multiplier is None
        for a, b in zip(reference, folded):
            assert torch.equal(b, a) and torch.equal(b.grad, a.grad)
        for s, t in zip(opt_ref.state.values(), opt_fold.state.values()):
            assert all(torch.equal(s[key], t[key]) for key in s)
