"""PrecisionAwareAdamW's Triton kernel (fused=True, optim/fused.py) against its foreach path on the
GPU: every master mode × fp32/bf16 moments × fp32/bf16 gradients, with and without a folded clip
coefficient, on a 1-element parameter, sizes that leave the last block partial, and a 3-D expert
weight; 5 steps with weight decay.

Each step starts the kernel from the reference's states, so one step's arithmetic is compared: a
bf16 state one ulp apart would otherwise change every later update of that element by far more
than an fp32 ulp. The kernel performs the foreach path's roundings (optim/fused.py says how), so
the states come out equal on the H200; the tolerances leave room for another compiler contracting
an FMA differently:
  fp32 states (masters, moments, the master rebuilt from bf16 + remainder): rtol 1e-6 (a few fp32
  ulps), atol 1e-8 where an element passes near zero (there the difference is an ulp of the update,
  lr·2^-23 ≈ 1e-9, not of the value);
  bf16 states (parameters, moments): one bf16 ulp (an fp32 ulp can move the rounding across a tie);
  fp8 moments: one e4m3 ulp, and their block scales as fp32 states.
fp8 moments (e4m3 with a scale per block of 128 along the last dimension) take the kernel's
whole-block variant, alone or beside an fp32 / bf16 moment.
"""

import pytest
import torch

from moefold.optim.adamw import ClipInFusedPrecisionAdamW
from moefold.optim.fused import triton_available
from moefold.optim.precision import PrecisionAwareAdamW, join_fp32
from moefold.parallel.data import GradNormClipper, scale_gradients

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not triton_available():
    pytest.skip("needs Triton", allow_module_level=True)

SHAPES = [(1,), (4097,), (300, 70), (8, 256, 384)]  # one element; partial last blocks; experts
HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 5
COEF = 0.37


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen)) for shape in SHAPES]


def _pair(master: str, moments: str, **hp) -> tuple[PrecisionAwareAdamW, PrecisionAwareAdamW]:
    """(kernel, foreach reference) over equal parameters; `moments` "fp8", or "fp8/bf16" for
    exp_avg / exp_avg_sq."""
    exp_avg, _, exp_avg_sq = moments.partition("/")
    options = {**HP, **hp, "master": master, "exp_avg_dtype": exp_avg, "exp_avg_sq_dtype": exp_avg_sq or exp_avg}
    return (PrecisionAwareAdamW(_params(), **options, fused=True),
            PrecisionAwareAdamW(_params(), **options, fused=False))


def _params_of(opt):
    return opt.param_groups[0]["params"]


def _give_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """p.grad = g, also where g's dtype is not p's: autograd's setter refuses that, the optimizer
    reads any fp32 or bf16 gradient."""
    p.grad = torch.empty_like(p)
    p.grad.data = g


def _give_equal_grads(fused: PrecisionAwareAdamW, ref: PrecisionAwareAdamW, gen: torch.Generator) -> None:
    """The same fp32 gradient, 3·N(0, 1), to each pair of parameters."""
    for p, q in zip(_params_of(fused), _params_of(ref), strict=True):
        g = 3 * torch.randn(p.shape, device="cuda", generator=gen)
        _give_grad(p, g.clone())
        _give_grad(q, g)


def _sync(dst: PrecisionAwareAdamW, src: PrecisionAwareAdamW) -> None:
    """dst's parameters and states set to src's."""
    for p, q in zip(_params_of(dst), _params_of(src), strict=True):
        p.detach().copy_(q.detach())
        for key, value in src.state[q].items():
            dst.state[p][key].copy_(value)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable bf16 or e4m3 values between a and b (sign-magnitude bits on one integer line)."""
    signed, sign_bit = {torch.bfloat16: (torch.int16, 32768), torch.float8_e4m3fn: (torch.int8, 128)}[a.dtype]

    def line(t):
        bits = t.contiguous().view(signed).int()
        return torch.where(bits < 0, -(bits + sign_bit), bits)
    return (line(a) - line(b)).abs()


def _assert_state_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, what
    if actual.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        ulps = _ulps(actual, expected).max().item()
        assert ulps <= 1, f"{what}: {ulps} {actual.dtype} ulps apart"
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-8, msg=lambda m: f"{what}: {m}")


def _assert_same_states(fused: PrecisionAwareAdamW, ref: PrecisionAwareAdamW, step: int) -> None:
    for shape, p, q in zip(SHAPES, _params_of(fused), _params_of(ref), strict=True):
        where = f"step {step}, shape {shape}"
        _assert_state_close(p.detach(), q.detach(), f"param, {where}")
        s, t = fused.state[p], ref.state[q]
        assert s["step"] == t["step"], where
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            if key in t:
                _assert_state_close(s[key], t[key], f"{key}, {where}")
        if "master_remainder" in s:
            _assert_state_close(join_fp32(p.detach(), s["master_remainder"]),
                                join_fp32(q.detach(), t["master_remainder"]), f"rebuilt master, {where}")


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["grad-fp32", "grad-bf16"])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp8", "fp8/bf16", "fp32/fp8"])
@pytest.mark.parametrize("master", ["fp32", "bf16", "bf16+remainder"])
def test_kernel_steps_like_the_foreach_path(master, moments, grad_dtype, clip):
    fused, ref = _pair(master, moments)
    coef = torch.tensor(COEF, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(1, STEPS + 1):
        _sync(fused, ref)
        grads = [(3 * torch.randn(shape, device="cuda", generator=gen)).to(grad_dtype) for shape in SHAPES]
        for p, q, g in zip(_params_of(fused), _params_of(ref), grads, strict=True):
            _give_grad(p, g.clone())
            # The reference gets the gradient the kernel forms in registers: fp32 g·coef.
            _give_grad(q, g.float() * coef if clip else g.clone())
        if clip:
            fused.grad_multiplier = coef
        fused.step()
        ref.step()
        assert fused.grad_multiplier is None  # consumed: a later step without clipping is not scaled
        _assert_same_states(fused, ref, step)
        for p, g in zip(_params_of(fused), grads, strict=True):  # left clipped, as in-place scaling
            expected = (g.float() * coef).to(grad_dtype) if clip else g
            assert p.grad.dtype == grad_dtype and torch.equal(p.grad, expected)
    start = _params()
    assert all((p.detach().float() - q).abs().max() > 1e-3 for p, q in zip(_params_of(ref), start))  # it moved


@pytest.mark.parametrize("betas", [(0.3, 0.99), (0.5, 0.9)], ids=["beta1-0.3", "beta1-0.5"])
def test_kernel_lerps_like_torch_for_large_weights(betas):
    """1 − beta1 >= 0.5: torch's lerp takes its other formula, g − (g − m)·(1 − w)."""
    fused, ref = _pair("bf16+remainder", "fp32", betas=betas)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for step in range(1, STEPS + 1):
        _sync(fused, ref)
        for p, q in zip(_params_of(fused), _params_of(ref), strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype)
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        ref.step()
        _assert_same_states(fused, ref, step)


def test_clipping_in_the_kernel_steps_like_clipping_in_place():
    """The trainer's clipper with the kernel strategy, against scaling the gradients in place: fp32
    gradients, whose in-place product is the one the kernel forms."""
    fused, ref = _pair("bf16+remainder", "bf16")
    clip_fused = GradNormClipper(_params_of(fused), scale=ClipInFusedPrecisionAdamW(fused))
    clip_ref = GradNormClipper(_params_of(ref), scale=scale_gradients)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step in range(1, STEPS + 1):
        _sync(fused, ref)
        _give_equal_grads(fused, ref, gen)
        norms = clip_fused(1.0), clip_ref(1.0)
        torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0)
        assert norms[0] > 1.0  # it clipped
        fused.step()
        ref.step()
        _assert_same_states(fused, ref, step)
        for p, q in zip(_params_of(fused), _params_of(ref), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_non_contiguous_tensors_are_refused():
    from moefold.optim.fused import fused_adamw_step_

    x = torch.zeros(64, 64, device="cuda")
    with pytest.raises(ValueError, match="grad is not contiguous"):
        fused_adamw_step_(x, x.clone().t(), x.clone(), x.clone(), None, lr=1e-3, beta1=0.9, beta2=0.95,
                          eps=1e-8, weight_decay=0.0, step=1)


def test_fp8_moments_of_a_piece_that_splits_its_rows_take_the_foreach_path(monkeypatch):
    """Where a piece does not hold its fp8 blocks whole (a last dimension split over ranks: here
    the block layout of columns 64.. of a wider tensor, as a rank's slice would have), the kernel
    leaves that parameter to the foreach path, which completes the blocks; the others it steps."""
    import moefold.optim.precision as precision
    from moefold.optim.blocks import RowBlocks

    fused, ref = _pair("bf16+remainder", "fp8")
    split = {id(opt): _params_of(opt)[2] for opt in (fused, ref)}  # the (300, 70) parameter
    for opt in (fused, ref):
        p = split[id(opt)]
        opt._row_blocks[p] = RowBlocks(rows=300, cols=70, col0=64, n_blocks=2)  # blocks 0 and 1, partly
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            opt.state[p][key] = torch.ones(300, 2, device="cuda")
    kernel_calls = []
    kernel = precision.fused_adamw_step_
    monkeypatch.setattr(precision, "fused_adamw_step_",
                        lambda param, *a, **k: kernel_calls.append(param.shape) or kernel(param, *a, **k))
    gen = torch.Generator(device="cuda").manual_seed(4)
    for step in range(1, STEPS + 1):
        _sync(fused, ref)
        _give_equal_grads(fused, ref, gen)
        fused.step()
        ref.step()
        _assert_same_states(fused, ref, step)
    assert torch.Size((300, 70)) not in kernel_calls and len(kernel_calls) == STEPS * (len(SHAPES) - 1)
