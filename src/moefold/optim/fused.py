"""PrecisionAwareAdamW's update in one pass over memory on CUDA (`PrecisionAwareAdamW(fused=True)`).

A Triton kernel reads each element's gradient, master weight and moments once, runs the AdamW
arithmetic in fp32 registers and writes master and moments back in their own dtypes. The foreach
path (optim/precision.py) builds fp32 working copies of all of them and makes about ten passes.

Handled: moments in fp32, bf16 or fp8 (e4m3 with one fp32 scale per block of 128 elements along
the last dimension, optim/blocks.py: a program then holds whole blocks, takes each block's maximum
in registers and writes the new scales, where the foreach path makes separate passes for the
maximum, the division and the cast; only for pieces that hold their blocks whole — where the last
dimension is split across a block, its maximum needs an all-reduce and the foreach path does
it), every master mode (fp32; bf16 rounded to nearest; bf16 + int16 remainder, split and joined
with `split_fp32` / `join_fp32`'s bit arithmetic), gradients in fp32 or bf16, optionally multiplied
by a coefficient read on the device (the clip coefficient: no host sync).

The arithmetic is the foreach path's on CUDA, op for op and rounding for rounding: each torch op
rounds once, except that nvcc contracts `a + s·b` in torch's lerp, addcmul and addcdiv kernels into
one FMA. The kernel spells those FMAs out and is compiled with no other contraction
(`enable_fp_fusion=False`), with IEEE division and square root (Triton's `/` and `sqrt` are the
approximate instructions), so it rounds where torch rounds; an fp8 block's scale is its maximum
times the fp32 reciprocal of 448, as torch's CUDA division by a Python number computes it.

Triton is imported if present: on machines without it (CPU CI) this module imports, the kernel is
not defined and `triton_available()` says so.

Legend: B elements of one program's block; with fp8 moments T scaling blocks of Q = 128 elements.
"""

import torch

from moefold.optim.blocks import BLOCK as FP8_BLOCK
from moefold.optim.blocks import FP8, FP8_MAX, FP8_MIN_SUBNORMAL, FP32_TINY

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
HAS_TRITON = triton is not None

BLOCK = 4096
NUM_WARPS = 8
FUSED_MOMENT_DTYPES = ("fp32", "bf16", "fp8")
_STATE_DTYPES = (torch.float32, torch.bfloat16)  # gradients, moments, masters
FP8_MAX_RECIPROCAL = (torch.tensor(1.0) / FP8_MAX).item()  # fp32 1/448: torch's `t.div(448)` on CUDA
TILE_BLOCKS = 16  # scaling blocks a program updates: 8 elements a thread with NUM_WARPS (16 a
# thread ran at 0.74× the bandwidth on the H200, benchmarks/adamw_step.py)


def triton_available() -> bool:
    """Whether the kernel can run here: Triton imports and torch sees a CUDA device."""
    return HAS_TRITON and torch.cuda.is_available()


def fused_supported(exp_avg_dtype: str, exp_avg_sq_dtype: str) -> bool:
    """Whether the kernel handles moments of these dtypes (PrecisionAwareAdamW's names)."""
    return exp_avg_dtype in FUSED_MOMENT_DTYPES and exp_avg_sq_dtype in FUSED_MOMENT_DTYPES


def fused_adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, remainder: torch.Tensor | None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                      grad_multiplier: torch.Tensor | None = None,
                      exp_avg_scale: torch.Tensor | None = None,
                      exp_avg_sq_scale: torch.Tensor | None = None) -> None:
    """One AdamW step of one parameter, in place, on plain contiguous CUDA tensors of one shape
    (local shards): `param` fp32, or bf16 (with `remainder`, int16, for "bf16+remainder"); `grad`
    fp32 or bf16; the moments fp32, bf16 or fp8 — an fp8 moment with its fp32 block scales
    `[..., ceil(last dim / 128)]` (for exp_avg_sq, those of sqrt(v)), the piece holding whole rows.
    `step` counts this step (1 for the first).

    grad_multiplier: an fp32 one-element tensor on the device that MULTIPLIES every gradient as it
    is read (the clip coefficient; torch's fused AdamW's `grad_scale` divides instead). The scaled
    gradient is written back into `grad`, which is left as scaling it in place leaves it."""
    _check(param, grad, exp_avg, exp_avg_sq, remainder, grad_multiplier, exp_avg_scale, exp_avg_sq_scale)
    n = param.numel()
    if n == 0:
        return
    w1 = 1 - beta1
    tensors = (param, param if remainder is None else remainder, grad, exp_avg, exp_avg_sq)
    hyper = (float(1 - lr * weight_decay), float(w1), float(1 - beta2), float(beta2),
             float((1 - beta2 ** step) ** 0.5), float(eps), float(-(lr / (1 - beta1 ** step))))
    flags = dict(HAS_REMAINDER=remainder is not None, HAS_MULTIPLIER=grad_multiplier is not None,
                 LERP_SMALL=abs(w1) < 0.5, num_warps=NUM_WARPS, enable_fp_fusion=False)
    multiplier = param if grad_multiplier is None else grad_multiplier
    with torch.cuda.device(param.device):  # Triton launches on the current device
        if exp_avg.dtype != FP8 and exp_avg_sq.dtype != FP8:
            _adamw_kernel[(triton.cdiv(n, BLOCK),)](*tensors, multiplier, n, *hyper, BLOCK=BLOCK, **flags)
            return
        cols = param.shape[-1] if param.dim() else 1
        blocks = (n // cols) * triton.cdiv(cols, FP8_BLOCK)
        _adamw_fp8_blocks_kernel[(triton.cdiv(blocks, TILE_BLOCKS),)](
            *tensors, param if exp_avg_scale is None else exp_avg_scale,
            param if exp_avg_sq_scale is None else exp_avg_sq_scale, multiplier, blocks, cols,
            triton.cdiv(cols, FP8_BLOCK), *hyper, FP8_MAX, FP8_MAX_RECIPROCAL, FP32_TINY,
            FP8_MIN_SUBNORMAL, M_FP8=exp_avg.dtype == FP8, V_FP8=exp_avg_sq.dtype == FP8,
            TILE=TILE_BLOCKS, Q=FP8_BLOCK, **flags)


def _check(param, grad, exp_avg, exp_avg_sq, remainder, grad_multiplier, exp_avg_scale,
           exp_avg_sq_scale) -> None:
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
        want = ((torch.int16,) if name == "remainder" else
                (*_STATE_DTYPES, FP8) if name.startswith("exp_avg") else _STATE_DTYPES)
        if t.dtype not in want:
            raise ValueError(f"fused AdamW: {name} is {t.dtype}; allowed: {', '.join(map(str, want))}")
    shape = tuple(param.shape) or (1,)
    scale_shape = (*shape[:-1], -(-shape[-1] // FP8_BLOCK))
    moments = (("exp_avg", exp_avg, exp_avg_scale), ("exp_avg_sq", exp_avg_sq, exp_avg_sq_scale))
    for name, moment, scale in moments:
        if (moment.dtype == FP8) != (scale is not None):
            raise ValueError(f"fused AdamW: {name}_scale is given exactly for an fp8 {name}")
        if scale is not None and (tuple(scale.shape) != scale_shape or scale.dtype != torch.float32
                                  or not scale.is_contiguous() or scale.device != param.device):
            raise ValueError(f"fused AdamW: {name}_scale must be contiguous fp32 {list(scale_shape)} on "
                             f"{param.device} (one per block of {FP8_BLOCK} along the last dimension), got "
                             f"{scale.dtype} {list(scale.shape)} on {scale.device}")
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
    def _adamw_update(x, g, m, v, decay, w1, w2, beta2, bias2_sqrt, eps, neg_step_size,
                      LERP_SMALL: tl.constexpr):
        """One element's AdamW in fp32, rounding where the foreach path's torch ops round."""
        x = x * decay
        # torch's lerp: m + w·(g − m) for |w| < 0.5, else g − (g − m)·(1 − w) (ATen's Lerp.h)
        if LERP_SMALL:
            m = tl.fma(w1, g - m, m)
        else:
            m = tl.fma(m - g, 1.0 - w1, g)
        v = tl.fma(w2, g * g, v * beta2)  # addcmul: v + s·(g·g)
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        x = tl.fma(neg_step_size, tl.div_rn(m, denom), x)  # addcdiv: x + s·(m / denom)
        return x, m, v

    @triton.jit
    def _load_grad_and_master(x_ptr, rem_ptr, g_ptr, mult_ptr, offs, mask, HAS_REMAINDER: tl.constexpr,
                              HAS_MULTIPLIER: tl.constexpr):
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if HAS_MULTIPLIER:
            g = g * tl.load(mult_ptr)
            tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)
        if HAS_REMAINDER:
            x = _join_fp32(tl.load(x_ptr + offs, mask=mask), tl.load(rem_ptr + offs, mask=mask))
        else:
            x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        return x, g

    @triton.jit
    def _store_master(x_ptr, rem_ptr, offs, mask, x, HAS_REMAINDER: tl.constexpr):
        if HAS_REMAINDER:
            hi, rem = _split_fp32(x)
            tl.store(x_ptr + offs, hi, mask=mask)
            tl.store(rem_ptr + offs, rem, mask=mask)
        else:
            tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_kernel(x_ptr, rem_ptr, g_ptr, m_ptr, v_ptr, mult_ptr, n, decay, w1, w2, beta2,
                      bias2_sqrt, eps, neg_step_size, HAS_REMAINDER: tl.constexpr,
                      HAS_MULTIPLIER: tl.constexpr, LERP_SMALL: tl.constexpr, BLOCK: tl.constexpr):
        offs_B = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # shards past 2^31 elements
        mask_B = offs_B < n
        x_B, g_B = _load_grad_and_master(x_ptr, rem_ptr, g_ptr, mult_ptr, offs_B, mask_B, HAS_REMAINDER,
                                         HAS_MULTIPLIER)
        m_B = tl.load(m_ptr + offs_B, mask=mask_B).to(tl.float32)
        v_B = tl.load(v_ptr + offs_B, mask=mask_B).to(tl.float32)
        x_B, m_B, v_B = _adamw_update(x_B, g_B, m_B, v_B, decay, w1, w2, beta2, bias2_sqrt, eps,
                                      neg_step_size, LERP_SMALL)
        tl.store(m_ptr + offs_B, m_B.to(m_ptr.dtype.element_ty), mask=mask_B)
        tl.store(v_ptr + offs_B, v_B.to(v_ptr.dtype.element_ty), mask=mask_B)
        _store_master(x_ptr, rem_ptr, offs_B, mask_B, x_B, HAS_REMAINDER)

    @triton.jit
    def _quantize_blocks(x_TQ, mask_TQ, fp8_max, fp8_max_reciprocal, tiny, floor, HAS_FLOOR: tl.constexpr):
        """optim/blocks.py's quantize_fp8 of whole blocks: (e4m3 [T, Q], fp32 scales [T])."""
        amax_T = tl.max(tl.where(mask_TQ, tl.abs(x_TQ), 0.0), axis=1)
        scale_T = tl.maximum(amax_T * fp8_max_reciprocal, tiny)
        q_TQ = tl.minimum(tl.maximum(tl.div_rn(x_TQ, scale_T[:, None]), -fp8_max), fp8_max)
        if HAS_FLOOR:
            q_TQ = tl.maximum(q_TQ, floor)
        return q_TQ.to(tl.float8e4nv), scale_T

    @triton.jit
    def _adamw_fp8_blocks_kernel(x_ptr, rem_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, mult_ptr,
                                 n_blocks, cols, blocks_per_row, decay, w1, w2, beta2, bias2_sqrt, eps,
                                 neg_step_size, fp8_max, fp8_max_reciprocal, tiny, sqrt_v_floor,
                                 M_FP8: tl.constexpr, V_FP8: tl.constexpr, HAS_REMAINDER: tl.constexpr,
                                 HAS_MULTIPLIER: tl.constexpr, LERP_SMALL: tl.constexpr,
                                 TILE: tl.constexpr, Q: tl.constexpr):
        """The kernel above over T whole scaling blocks (row r, block j: scale index r·N + j) of a
        piece viewed as [rows, cols], cols split into N = blocks_per_row blocks of Q (the last may
        be short); fp8 moments dequantized on load, re-scaled and quantized on store."""
        block_T = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        col_TQ = (block_T % blocks_per_row)[:, None] * Q + tl.arange(0, Q)[None, :]
        offs_TQ = (block_T // blocks_per_row)[:, None] * cols + col_TQ
        in_T = block_T < n_blocks
        mask_TQ = in_T[:, None] & (col_TQ < cols)
        x_TQ, g_TQ = _load_grad_and_master(x_ptr, rem_ptr, g_ptr, mult_ptr, offs_TQ, mask_TQ, HAS_REMAINDER,
                                           HAS_MULTIPLIER)
        m_TQ = tl.load(m_ptr + offs_TQ, mask=mask_TQ).to(tl.float32)
        if M_FP8:
            m_TQ = m_TQ * tl.load(ms_ptr + block_T, mask=in_T)[:, None]
        v_TQ = tl.load(v_ptr + offs_TQ, mask=mask_TQ).to(tl.float32)
        if V_FP8:  # holds sqrt(v)
            v_TQ = v_TQ * tl.load(vs_ptr + block_T, mask=in_T)[:, None]
            v_TQ = v_TQ * v_TQ
        x_TQ, m_TQ, v_TQ = _adamw_update(x_TQ, g_TQ, m_TQ, v_TQ, decay, w1, w2, beta2, bias2_sqrt, eps,
                                         neg_step_size, LERP_SMALL)
        if M_FP8:
            q_TQ, scale_T = _quantize_blocks(m_TQ, mask_TQ, fp8_max, fp8_max_reciprocal, tiny, 0.0, False)
            tl.store(m_ptr + offs_TQ, q_TQ, mask=mask_TQ)
            tl.store(ms_ptr + block_T, scale_T, mask=in_T)
        else:
            tl.store(m_ptr + offs_TQ, m_TQ.to(m_ptr.dtype.element_ty), mask=mask_TQ)
        if V_FP8:
            q_TQ, scale_T = _quantize_blocks(tl.sqrt_rn(v_TQ), mask_TQ, fp8_max, fp8_max_reciprocal, tiny,
                                             sqrt_v_floor, True)
            tl.store(v_ptr + offs_TQ, q_TQ, mask=mask_TQ)
            tl.store(vs_ptr + block_T, scale_T, mask=in_T)
        else:
            tl.store(v_ptr + offs_TQ, v_TQ.to(v_ptr.dtype.element_ty), mask=mask_TQ)
        _store_master(x_ptr, rem_ptr, offs_TQ, mask_TQ, x_TQ, HAS_REMAINDER)
