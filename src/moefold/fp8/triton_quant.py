"""FP8 quantization of the routed experts' column-scaled operands in Triton: one scale per column
within each group of rows, the FP8 values written transposed (each column's rows contiguous), as
the grouped GEMMs read them (fp8/grouped.py's layout table).

  group columns   x_RC with groups of rows [offsets_E[e-1], offsets_E[e])  → xT_CR, scale_EC
                  the weight gradient's x and grad (contraction over each expert's rows)
  batch columns   x_GRC, every batch entry one group of R rows              → xT_GCR, scale_GC
                  an expert weight's transpose (grad_input's operand, read along its rows)
  expert weight   w_EKN in its own layout                                    → wT_ENK, scale_EN
                  the forward's operand, scaled per output column over the contraction

The plain-PyTorch path (fp8/grouped.py: `quantize_group_columns`, `quantize` with "col" tiles,
then a transposing copy) is the reference; tests/gpu/test_fp8_gpu.py checks that both give the same
FP8 bytes and scales. Why a kernel: under torch.compile the reference's per-group amax is a
scatter-reduce that Inductor leaves to aten (664 GB/s at Qwen3's shape on the H200) and the
transposed copy is one more pass; here each program reads its group's column block twice (amax,
then scale, cast and a transposed store), the second read mostly from L2.

An expert weight in its own layout has too many rows for that: a program's column block of all K
rows (256 KB at Qwen3's shape) falls out of L2 before the second read. It takes two kernels, each
reading the weight once: the column scales (program: expert, column block), then the cast and
transposed store (program: expert, tile). On the H200 at Qwen3's and DeepSeek-V2-Lite's expert
weights: 0.30-0.33 ms where the column kernel took 0.37-0.42 (docs/benchmarks.md, 2026-11-30,
"one read"), as fast as Inductor's fusion of the plain-PyTorch path, and also eagerly (the weight
cache's refresh).

Rows past the last group are neither read nor written (the GEMMs never read them). The scale is
`amax * (1 / fp8_max)` and the division by it IEEE-rounded (`div_rn`: Triton's `/` is not), as
the reference computes them, so the FP8 values and scales match it bit for bit.
"""

from __future__ import annotations

import torch

from moefold.fp8.recipes import FORMATS, Fp8Format

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # CPU-only installs
    triton = None
HAS_TRITON = triton is not None

TALL_TILES = {"BR": 256, "BC": 32, "num_warps": 8}
"""Tiles for the activations' per-group columns and for a weight read through its transpose
(grad_input's layout), chosen by a sweep on the H200 at Qwen3's and DeepSeek-V2-Lite's expert
shapes (docs/benchmarks.md, fifth pass): 10-35% faster than 128x64 tiles of 4 warps."""
EXPERT_WEIGHT_TILES = {"BK": 64, "BN": 64, "num_warps": 4}
"""Tiles of the expert-weight kernels (scales: BN columns, all K rows in BK steps; cast: BK x BN),
within 1% of the fastest of 18 tried (BK 32-128, BN 64-256, 4 or 8 warps) on the H200."""
ROW_ALIGN = 16
"""The transposed outputs' row count is padded to this: the GEMMs read them with a row stride of
R bytes, which must be a multiple of 16."""


def _format_constants(fmt: str) -> dict:
    """The format's bounds as compile-time constants (a float argument would arrive as fp64 when
    Inductor launches the kernel)."""
    f = FORMATS[fmt]
    return {"FP8_MAX": f.max, "INV_FP8_MAX": f.inv_max}


if HAS_TRITON:

    @triton.jit
    def _scale_of(amax, INV_FP8_MAX: tl.constexpr):
        """recipes.tile_scale: amax · (1/fp8_max), 1 where that is 0 (a zero or underflowing amax)."""
        scale = amax * INV_FP8_MAX
        return tl.where(scale > 0, scale, 1.0)

    @triton.jit
    def _to_fp8(x, scale, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
        """recipes.quantize_tiles' cast: x / scale IEEE-rounded, saturated to ±fp8_max."""
        return tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX).to(dtype)

    @triton.jit
    def _fp8_quantize_columns_t(x_ptr, out_ptr, scale_ptr, offsets_ptr, C, rows_per_group,
                                stride_xg, stride_xr, stride_xc, stride_og, stride_or, stride_oc,
                                FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, GROUPED_ROWS: tl.constexpr,
                                BR: tl.constexpr, BC: tl.constexpr):
        """Program (column block, group): the group's column amax, then its rows scaled, cast and
        stored transposed. Grouped rows are global indices from offsets; batched rows start at 0
        in each batch entry (stride_xg, stride_og)."""
        pid_c, g = tl.program_id(0), tl.program_id(1)
        if GROUPED_ROWS:
            row_start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0)
            row_end = tl.load(offsets_ptr + g)
        else:
            row_start = 0
            row_end = rows_per_group
        cols_C = pid_c * BC + tl.arange(0, BC)
        in_cols_C = cols_C < C
        x_g = x_ptr + g.to(tl.int64) * stride_xg
        amax_C = tl.zeros((BC,), dtype=tl.float32)
        for r in range(row_start, row_end, BR):
            rows_R = r + tl.arange(0, BR)
            mask = (rows_R < row_end)[:, None] & in_cols_C[None, :]
            x_RC = tl.load(x_g + rows_R[:, None].to(tl.int64) * stride_xr + cols_C[None, :] * stride_xc,
                           mask=mask, other=0.0)
            amax_C = tl.maximum(amax_C, tl.max(tl.abs(x_RC.to(tl.float32)), axis=0))
        scale_C = _scale_of(amax_C, INV_FP8_MAX)
        tl.store(scale_ptr + g * C + cols_C, scale_C, mask=in_cols_C)
        out_g = out_ptr + g.to(tl.int64) * stride_og
        for r in range(row_start, row_end, BR):
            rows_R = r + tl.arange(0, BR)
            mask = (rows_R < row_end)[:, None] & in_cols_C[None, :]
            x_RC = tl.load(x_g + rows_R[:, None].to(tl.int64) * stride_xr + cols_C[None, :] * stride_xc,
                           mask=mask, other=0.0)
            q_RC = _to_fp8(x_RC, scale_C[None, :], FP8_MAX, out_ptr.dtype.element_ty)
            tl.store(out_g + rows_R[:, None].to(tl.int64) * stride_or + cols_C[None, :].to(tl.int64) * stride_oc,
                     q_RC, mask=mask)

    @triton.jit
    def _fp8_weight_column_scales(w_ptr, scale_ptr, K, N, stride_we, stride_wk, INV_FP8_MAX: tl.constexpr,
                                  BK: tl.constexpr, BN: tl.constexpr):
        """Program (expert, column block): the columns' scales from one read of their K rows."""
        e, pid_n = tl.program_id(0), tl.program_id(1)
        cols_N = pid_n * BN + tl.arange(0, BN)
        in_cols_N = cols_N < N
        w_e = w_ptr + e.to(tl.int64) * stride_we
        amax_N = tl.zeros((BN,), dtype=tl.float32)
        for k in range(0, K, BK):
            rows_K = k + tl.arange(0, BK)
            mask = (rows_K < K)[:, None] & in_cols_N[None, :]
            w_KN = tl.load(w_e + rows_K[:, None].to(tl.int64) * stride_wk + cols_N[None, :], mask=mask, other=0.0)
            amax_N = tl.maximum(amax_N, tl.max(tl.abs(w_KN.to(tl.float32)), axis=0))
        tl.store(scale_ptr + e * N + cols_N, _scale_of(amax_N, INV_FP8_MAX), mask=in_cols_N)

    @triton.jit
    def _fp8_weight_cast_t(w_ptr, scale_ptr, out_ptr, K, N, stride_we, stride_wk, FP8_MAX: tl.constexpr,
                           BK: tl.constexpr, BN: tl.constexpr):
        """Program (expert, row block, column block): a BK x BN tile scaled per column, cast and
        stored transposed into out [E, N, K]."""
        e, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows_K = pid_k * BK + tl.arange(0, BK)
        cols_N = pid_n * BN + tl.arange(0, BN)
        in_cols_N = cols_N < N
        mask = (rows_K < K)[:, None] & in_cols_N[None, :]
        e64 = e.to(tl.int64)
        w_KN = tl.load(w_ptr + e64 * stride_we + rows_K[:, None].to(tl.int64) * stride_wk + cols_N[None, :],
                       mask=mask, other=0.0)
        scale_N = tl.load(scale_ptr + e * N + cols_N, mask=in_cols_N, other=1.0)
        q_KN = _to_fp8(w_KN, scale_N[None, :], FP8_MAX, out_ptr.dtype.element_ty)
        tl.store(out_ptr + e64 * N * K + cols_N[None, :].to(tl.int64) * K + rows_K[:, None], q_KN, mask=mask)

    @triton_op("moefold::fp8_quantize_expert_weight", mutates_args=())
    def fp8_quantize_expert_weight(w_EKN: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(wT_fp8 [E, N, K] contiguous, scale [E, N]): each expert's columns scaled over K, w in
        its own layout (unit column stride); the forward's operand."""
        if w_EKN.stride(2) != 1:
            raise ValueError("fp8_quantize_expert_weight reads w in its own layout (unit column stride)")
        (E, K, N), t, consts = w_EKN.shape, EXPERT_WEIGHT_TILES, _format_constants(fmt)
        wT_ENK = torch.empty(E, N, K, device=w_EKN.device, dtype=FORMATS[fmt].dtype)
        scale_EN = torch.empty(E, N, device=w_EKN.device, dtype=torch.float32)
        strides = (w_EKN.stride(0), w_EKN.stride(1))
        wrap_triton(_fp8_weight_column_scales)[(E, triton.cdiv(N, t["BN"]))](
            w_EKN, scale_EN, K, N, *strides, INV_FP8_MAX=consts["INV_FP8_MAX"], BK=t["BK"], BN=t["BN"],
            num_warps=t["num_warps"])
        wrap_triton(_fp8_weight_cast_t)[(E, triton.cdiv(K, t["BK"]), triton.cdiv(N, t["BN"]))](
            w_EKN, scale_EN, wT_ENK, K, N, *strides, FP8_MAX=consts["FP8_MAX"], BK=t["BK"], BN=t["BN"],
            num_warps=t["num_warps"])
        return wT_ENK, scale_EN

    @triton_op("moefold::fp8_quantize_group_columns_t", mutates_args=())
    def fp8_quantize_group_columns_t(x_RC: torch.Tensor, offsets_E: torch.Tensor,
                                     fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(xT_fp8 [C, R rounded up to 16], scale [E, C]): per-group column scales, x transposed."""
        (R, C), E = x_RC.shape, offsets_E.shape[0]
        t = TALL_TILES
        r_out = -(-R // ROW_ALIGN) * ROW_ALIGN
        xT_CR = torch.empty(C, r_out, device=x_RC.device, dtype=FORMATS[fmt].dtype)
        scale_EC = torch.empty(E, C, device=x_RC.device, dtype=torch.float32)
        wrap_triton(_fp8_quantize_columns_t)[(triton.cdiv(C, t["BC"]), E)](
            x_RC, xT_CR, scale_EC, offsets_E, C, 0, 0, x_RC.stride(0), x_RC.stride(1),
            0, xT_CR.stride(1), xT_CR.stride(0), **_format_constants(fmt), GROUPED_ROWS=True, **t)
        return xT_CR, scale_EC

    @triton_op("moefold::fp8_quantize_batch_columns_t", mutates_args=())
    def fp8_quantize_batch_columns_t(x_GRC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(xT_fp8 [G, C, R] contiguous, scale [G, C]): per-column scales over each entry's rows."""
        G, R, C = x_GRC.shape
        t = TALL_TILES
        xT_GCR = torch.empty(G, C, R, device=x_GRC.device, dtype=FORMATS[fmt].dtype)
        scale_GC = torch.empty(G, C, device=x_GRC.device, dtype=torch.float32)
        dummy_offsets = scale_GC  # not read: rows are uniform
        wrap_triton(_fp8_quantize_columns_t)[(triton.cdiv(C, t["BC"]), G)](
            x_GRC, xT_GCR, scale_GC, dummy_offsets, C, R, x_GRC.stride(0), x_GRC.stride(1),
            x_GRC.stride(2), xT_GCR.stride(0), xT_GCR.stride(2), xT_GCR.stride(1),
            **_format_constants(fmt), GROUPED_ROWS=False, **t)
        return xT_GCR, scale_GC


def quantize_group_columns_t(x_RC: torch.Tensor, offsets_E: torch.Tensor,
                             fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.moefold.fp8_quantize_group_columns_t(x_RC, offsets_E, fmt.name)


def quantize_batch_columns_t(x_GRC: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.moefold.fp8_quantize_batch_columns_t(x_GRC, fmt.name)


def quantize_expert_weight(w_EKN: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.moefold.fp8_quantize_expert_weight(w_EKN, fmt.name)
