"""PrecisionAwareAdamW's update in one pass over memory on CUDA (`PrecisionAwareAdamW(fused=True)`).

A Triton kernel reads each element's gradient, master weight and moments once, runs the AdamW
arithmetic in fp32 registers and writes master and moments back in their own dtypes. The foreach
path (optim/precision.py) builds fp32 working copies of all of them and makes about ten passes.

Handled: moments in fp32 or bf16 (fp8's per-block scales need a maximum over each block first: not
here), every master mode (fp32; bf16 rounded to nearest; bf16 + int16 remainder, split and joined
with `split_fp32` / `join_fp32`'s bit arithmetic), gradients in fp32 or bf16, optionally multiplied
by a coefficient read on the device (the clip coefficient: no host sync).

The arithmetic is the foreach path's on CUDA, op for op and rounding for rounding: each torch op
rounds once, except that nvcc contracts `a + s·b` in torch's lerp, addcmul and addcdiv kernels into
one FMA. The kernel spells those FMAs out and is compiled with no other contraction
(`enable_fp_fusion=False`), with IEEE division and square root (Triton's `/` and `sqrt` are the
approximate instructions), so it rounds where torch rounds.

Triton is imported if present: on machines without it (CPU CI) this module imports, the kernel is
not defined and `triton_available()` says so.

Legend: B elements of one program's block.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
HAS_TRITON = triton is not None

BLOCK = 4096
NUM_WARPS = 8
FUSED_MOMENT_DTYPES = ("fp32", "bf16")
_STATE_DTYPES = (torch.float32, torch.bfloat16)  # gradients, moments, masters


def triton_available() -> bool:
    """Whether the kernel can run here: Triton imports and torch sees a CUDA device."""
    return HAS_TRITON and torch.cuda.is_available()


def fused_supported(exp_avg_dtype: str, exp_avg_sq_dtype: str) -> bool:
    """Whether the kernel handles moments of these dtypes (PrecisionAwareAdamW's names)."""
    return exp_avg_dtype in FUSED_MOMENT_DTYPES and exp_avg_sq_dtype in FUSED_MOMENT_DTYPES


def fused_adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, remainder: torch.Tensor | None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                      grad_multiplier: torch.Tensor | None = None) -> None:
    """One AdamW step of one parameter, in place, on plain contiguous CUDA tensors of one shape
    (local shards): `param` fp32, or bf16 (with `remainder`, int16, for "bf16+remainder"); `grad`
    and the moments fp32 or bf16. `step` counts this step (1 for the first).

    grad_multiplier: an fp32 one-element tensor on the device that MULTIPLIES every gradient as it
    is read (the clip coefficient; torch's fused AdamW's `grad_scale` divides instead). The scaled
    gradient is written back into `grad`, which is left as scaling it in place leaves it."""
    _check(param, grad, exp_avg, exp_avg_sq, remainder, grad_multiplier)
    n = param.numel()
    if n == 0:
        return
    w1 = 1 - beta1
    with torch.cuda.device(param.device):  # Triton launches on the current device
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            param, param if remainder is None else remainder, grad, exp_avg, exp_avg_sq,
            param if grad_multiplier is None else grad_multiplier, n,
            float(1 - lr * weight_decay), float(w1), float(1 - beta2), float(beta2),
            float((1 - beta2 ** step) ** 0.5), float(eps), float(-(lr / (1 - beta1 ** step))),
            HAS_REMAINDER=remainder is not None, HAS_MULTIPLIER=grad_multiplier is not None,
            LERP_SMALL=abs(w1) < 0.5, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)


def _check(param, grad, exp_avg, exp_avg_sq, remainder, grad_multiplier) -> None:
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if remainder is not None:
        named["remainder"] = remainder
    for name, t in named.items():
        if t.device != param.device or t.device.type != "cuda":
            raise ValueError(f"fused AdamW: {name} is on {t.device}; all tensors must be on one CUDA device")
        if t.shape != param.shape:
            raise ValueError(f"fused AdamW: {name} has shape {tuple(t.shape)}, param {tuple(param.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"fused AdamW: {name} is not contiguous (the kernel indexes it flat)")
        want = (torch.int16,) if name == "remainder" else _STATE_DTYPES
        if t.dtype not in want:
            raise ValueError(f"fused AdamW: {name} is {t.dtype}; allowed: {', '.join(map(str, want))}")
    if remainder is not None and param.dtype != torch.bfloat16:
        raise ValueError(f"fused AdamW: a master remainder needs a bf16 param, got {param.dtype}")
    if grad_multiplier is not None and (grad_multiplier.dtype != torch.float32 or grad_multiplier.numel() != 1
                                        or grad_multiplier.device != param.device):
        raise ValueError(f"fused AdamW: grad_multiplier must be one fp32 element on {param.device}, got "
                         f"{grad_multiplier.dtype} {tuple(grad_multiplier.shape)} on {grad_multiplier.device}")


if HAS_TRITON:

    @triton.jit
    def _join_fp32(hi_B, rem_B):
        """`join_fp32`: the bf16 high half, less the round-up the remainder's sign records."""
        hi_B = hi_B.to(tl.uint16, bitcast=True).to(tl.uint32)
        hi_B = (hi_B - (rem_B < 0).to(tl.uint32)) & 0xFFFF
        bits_B = (hi_B << 16) | rem_B.to(tl.uint16, bitcast=True).to(tl.uint32)
        return bits_B.to(tl.float32, bitcast=True)

    @triton.jit
    def _split_fp32(x_B):
        """`split_fp32`: bf16 rounded half away from zero on the low 16 bits; those bits as int16."""
        bits_B = x_B.to(tl.uint32, bitcast=True)
        lo_B = bits_B & 0xFFFF
        hi_B = ((bits_B >> 16) + (lo_B >= 0x8000).to(tl.uint32)) & 0xFFFF  # a carry into the exponent is right
        return hi_B.to(tl.uint16).to(tl.bfloat16, bitcast=True), lo_B.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _adamw_kernel(x_ptr, rem_ptr, g_ptr, m_ptr, v_ptr, mult_ptr, n, decay, w1, w2, beta2,
                      bias2_sqrt, eps, neg_step_size, HAS_REMAINDER: tl.constexpr,
                      HAS_MULTIPLIER: tl.constexpr, LERP_SMALL: tl.constexpr, BLOCK: tl.constexpr):
        offs_B = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # shards past 2^31 elements
        mask_B = offs_B < n
        g_B = tl.load(g_ptr + offs_B, mask=mask_B).to(tl.float32)
        if HAS_MULTIPLIER:
            g_B = g_B * tl.load(mult_ptr)
            tl.store(g_ptr + offs_B, g_B.to(g_ptr.dtype.element_ty), mask=mask_B)
        if HAS_REMAINDER:
            x_B = _join_fp32(tl.load(x_ptr + offs_B, mask=mask_B), tl.load(rem_ptr + offs_B, mask=mask_B))
        else:
            x_B = tl.load(x_ptr + offs_B, mask=mask_B).to(tl.float32)
        m_B = tl.load(m_ptr + offs_B, mask=mask_B).to(tl.float32)
        v_B = tl.load(v_ptr + offs_B, mask=mask_B).to(tl.float32)

        x_B = x_B * decay
        # torch's lerp: m + w·(g − m) for |w| < 0.5, else g − (g − m)·(1 − w) (ATen's Lerp.h)
        if LERP_SMALL:
            m_B = tl.fma(w1, g_B - m_B, m_B)
        else:
            m_B = tl.fma(m_B - g_B, 1.0 - w1, g_B)
        v_B = tl.fma(w2, g_B * g_B, v_B * beta2)  # addcmul: v + s·(g·g)
        denom_B = tl.div_rn(tl.sqrt_rn(v_B), bias2_sqrt) + eps
        x_B = tl.fma(neg_step_size, tl.div_rn(m_B, denom_B), x_B)  # addcdiv: x + s·(m / denom)

        tl.store(m_ptr + offs_B, m_B.to(m_ptr.dtype.element_ty), mask=mask_B)
        tl.store(v_ptr + offs_B, v_B.to(v_ptr.dtype.element_ty), mask=mask_B)
        if HAS_REMAINDER:
            hi_B, rem_B = _split_fp32(x_B)
            tl.store(x_ptr + offs_B, hi_B, mask=mask_B)
            tl.store(rem_ptr + offs_B, rem_B, mask=mask_B)
        else:
            tl.store(x_ptr + offs_B, x_B.to(x_ptr.dtype.element_ty), mask=mask_B)
