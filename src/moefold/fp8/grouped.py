"""FP8 grouped GEMMs of the routed experts, forward and backward, through a backend fixed at build.

R routed rows grouped by expert (`offsets_E`: cumulative row ends, as torch._grouped_mm takes
them), K input features, N output features, E experts.

| GEMM          | operands                       | rowwise (also for tensorwise)  | blockwise          |
|---------------|--------------------------------|--------------------------------|--------------------|
| `forward`     | x_RK, w_EKN                    | row, col (per expert)          | 1x128, 128x128     |
| `grad_input`  | grad_RN, w_ENK (= w^T)         | row, col (per expert)          | 1x128, 128x128     |
| `grad_weight` | x_RK, grad_RN (per group a^T b)| col, col within each group     | 128x1, 128x1       |

Tensorwise has no grouped form (one scale over all experts' rows would couple the experts), so a
tensorwise run's experts use rowwise scaling, as torchao's FP8 MoE training does. The weight
gradient contracts over each expert's rows: its scales are per column *within each group* (rowwise,
a segmented amax over 16-row chunks with no host sync), or 128-row tiles that never straddle two
groups because every group is padded to a multiple of 128 (blockwise). Group sizes must be multiples of
`Fp8Scaling.row_multiple` (16 or 128): the MoE layer pads them (apply_fp8 raises its pad multiple).
Rows past the last offset are neither read nor written, as with torch._grouped_mm.
"""

from __future__ import annotations

import torch

from moefold.dtypes import cast
from moefold.errors import ConfigError
from moefold.fp8 import triton_grouped, triton_quant
from moefold.fp8.gemm import Fp8Scaling, GemmScaling, column_major, pad_rows
from moefold.fp8.recipes import BLOCK, Operand, fake_quant, quantize, tile_scale
from moefold.fp8.saved import SaveInput, kept_for_backward
from moefold.moe.grouped_mm import grouped_mm

COLUMN_CHUNK = 16
"""Rows per chunk of the per-group column scaling, and the rowwise grouped row multiple: every
chunk lies in one group (or past the last offset)."""


def grouped_scaling(recipe: str) -> Fp8Scaling:
    if recipe in ("tensorwise", "rowwise"):
        rc = GemmScaling(Operand("row"), Operand("col"))
        return Fp8Scaling("rowwise", rc, rc, GemmScaling(Operand("col"), Operand("col")), COLUMN_CHUNK)
    if recipe == "blockwise":
        fwd = GemmScaling(Operand("1x128"), Operand("128x128"))
        return Fp8Scaling("blockwise", fwd, fwd, GemmScaling(Operand("128x1"), Operand("128x1")), BLOCK)
    raise ValueError(f"precision.fp8={recipe!r} has no grouped scaling; allowed: tensorwise, rowwise, blockwise")


def _chunk_group_ids(offsets_E: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """gid_C: the expert of each COLUMN_CHUNK-row chunk; E past the last offset."""
    starts_C = torch.arange(num_chunks, device=offsets_E.device, dtype=offsets_E.dtype) * COLUMN_CHUNK
    return torch.searchsorted(offsets_E, starts_C, right=True)


def quantize_group_columns(x_RN: torch.Tensor, offsets_E: torch.Tensor,
                           op: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """x in FP8 with one scale per column within each group: (x_fp8 [R, N], scale [E, N])."""
    x_fp8_CcN, _, scale_GN = _quantize_chunks(x_RN, offsets_E, op)
    return x_fp8_CcN.view(x_RN.shape), scale_GN[: offsets_E.shape[0]]


def _quantize_chunks(x_RN: torch.Tensor, offsets_E: torch.Tensor, op: Operand):
    """(x_fp8 [C, COLUMN_CHUNK, N], each chunk's scales [C, 1, N], the groups' scales [E+1, N]).

    R and every group size are multiples of COLUMN_CHUNK (C chunks): the column amax is a dense
    reduction within each chunk (fused by the compiler), and only the chunks' [C, N] maxima are
    scattered into their groups, never an [R, N] copy.
    """
    if op.tile != "col":
        raise ValueError(f"quantize_group_columns: tile {op.tile!r}; allowed: 'col'")
    E, (R, N) = offsets_E.shape[0], x_RN.shape
    C = R // COLUMN_CHUNK
    x_CcN = x_RN.reshape(C, COLUMN_CHUNK, N)  # grad_RN may come non-contiguous
    gid_C = _chunk_group_ids(offsets_E, C)
    amax_GN = torch.zeros(E + 1, N, device=x_RN.device, dtype=torch.float32)
    amax_GN.scatter_reduce_(0, gid_C[:, None].expand(C, N), x_CcN.abs().amax(dim=1).float(), "amax")
    scale_GN = tile_scale(amax_GN, op.fmt)
    scale_C1N = scale_GN[gid_C][:, None, :]
    x_fp8_CcN = (x_CcN.float() / scale_C1N).clamp(-op.fmt.max, op.fmt.max).to(op.fmt.dtype)
    return x_fp8_CcN, scale_C1N, scale_GN


def fake_quant_groups(x_RN: torch.Tensor, offsets_E: torch.Tensor, op: Operand,
                      dtype: torch.dtype) -> torch.Tensor:
    """Dequantized FP8 values of a weight-gradient operand (tiles along rows, within groups)."""
    R, N = x_RN.shape
    if op.tile == "col":
        x_fp8_CcN, scale_C1N, _ = _quantize_chunks(pad_rows(x_RN, COLUMN_CHUNK), offsets_E, op)
        return (x_fp8_CcN.float() * scale_C1N).view(-1, N)[:R].to(dtype)
    return fake_quant(pad_rows(x_RN, BLOCK), op, dtype)[:R]


class TorchColumnQuantizer:
    """The column-scaled operands of the rowwise grouped GEMMs in plain PyTorch (any device):
    quantize, then a transposing copy into the layout the kernels read. The reference for
    TritonColumnQuantizer."""

    def weight(self, w_EKN, op: Operand):
        """(each expert's w in FP8, column-major, as [E, K, N]; its per-column scales [E, N])."""
        w_fp8, scale_E1N = quantize(w_EKN, op)
        return column_major(w_fp8), scale_E1N.flatten(1)

    def group_columns_t(self, x_RK, offsets_E, op: Operand):
        """(x^T in FP8, [K, R'] row-major, R' = R rounded up to 16; per-group column scales [E, K]).
        The kernels read x^T with a row stride of R' bytes, which must be a multiple of 16 (as
        quantize_group_columns' chunks): zero rows past the last offset (never read) pad R."""
        x_fp8, scale_EK = quantize_group_columns(pad_rows(x_RK, COLUMN_CHUNK), offsets_E, op)
        return x_fp8.t().contiguous(), scale_EK


class TritonColumnQuantizer:
    """TorchColumnQuantizer's operands, bit for bit, from Triton kernels (fp8/triton_quant.py): the
    amax, the cast and the transposed store in one pass over a group's columns, instead of
    Inductor's scatter-reduce and a separate transposing copy; a weight in its own layout in two
    kernels that each read it once. CUDA only."""

    def weight(self, w_EKN, op: Operand):
        if w_EKN.stride(-1) == 1:  # the forward's weight, in its own layout
            wT_ENK, scale_EN = triton_quant.quantize_expert_weight(w_EKN, op.fmt)
        else:  # grad_input's: w^T, read along its contiguous rows
            wT_ENK, scale_EN = triton_quant.quantize_batch_columns_t(w_EKN, op.fmt)
        return wT_ENK.transpose(-2, -1), scale_EN

    def group_columns_t(self, x_RK, offsets_E, op: Operand):
        return triton_quant.quantize_group_columns_t(x_RK, offsets_E, op.fmt)


TORCH_COLUMNS = TorchColumnQuantizer()


class EmulatedFp8GroupedGemm:
    """quantize → dequantize → torch._grouped_mm in the compute dtype; runs on any device.

    Every backend's GEMMs come in list form — several weights against one input (gate and up read
    the same x), several gradients against one input (their weight gradients) — so that the shared
    operand is quantized once; `grouped_mm` and `grouped_weight_grad` are the one-element cases."""

    name = "emulated"

    def grouped_mm(self, x_RK, w_EKN, offsets_E, scaling: GemmScaling, dtype):
        """x·w[e] over each expert's rows."""
        return self.grouped_mms(x_RK, [w_EKN], offsets_E, scaling, dtype)[0]

    def grouped_weight_grad(self, x_RK, grad_RN, offsets_E, scaling: GemmScaling, dtype):
        """grad_w_EKN[e] = x_e^T @ grad_e over each expert's rows."""
        return self.grouped_weight_grads(x_RK, [grad_RN], offsets_E, scaling, dtype)[0]

    def grouped_mms(self, x_RK, ws_EKN, offsets_E, scaling: GemmScaling, dtype) -> list:
        return self.grouped_mms_with(x_RK, [self.weight_operands(w_EKN, scaling.b) for w_EKN in ws_EKN],
                                     offsets_E, scaling, dtype)

    def weight_operands(self, w_EKN, op: Operand) -> tuple[torch.Tensor, ...]:
        """w as the rows GEMMs (forward, grad_input) multiply it, quantized as `op` says; here its
        dequantized FP8 values, in w's dtype. What `precision.fp8_weight_cache` keeps."""
        return (fake_quant(w_EKN, op, w_EKN.dtype),)

    def grouped_mms_with(self, x_RK, ws_operands, offsets_E, scaling: GemmScaling, dtype) -> list:
        """grouped_mms with each weight already in its operands (`weight_operands`)."""
        xq_RK = fake_quant(x_RK, scaling.a, dtype)
        return [grouped_mm(xq_RK, wq_EKN, offsets_E) for (wq_EKN,) in ws_operands]

    def grouped_weight_grads(self, x_RK, grads_RN, offsets_E, scaling: GemmScaling, dtype) -> list:
        xq_RK = fake_quant_groups(x_RK, offsets_E, scaling.a, dtype)
        return [grouped_mm(xq_RK.t(), fake_quant_groups(grad_RN, offsets_E, scaling.b, dtype), offsets_E)
                for grad_RN in grads_RN]


class ScaledGroupedMMFp8Gemm(EmulatedFp8GroupedGemm):
    """`torch._scaled_grouped_mm` (CUTLASS, sm90) for rowwise scales; blockwise grouped GEMMs have
    no torch kernel on Hopper, so they fall back to the emulation (slower than bf16). Not run in CI:
    tests/gpu/test_fp8_gpu.py compares it with the emulation.

    The kernel wants a row-major, b column-major per expert, float32 dequantization scales: [R] and
    [E, N] for 2d x 3d, [E·K] and [E·N] for the 2d x 2d weight gradient (torchao's fp8 MoE layout).
    """

    name = "scaled_grouped_mm"
    columns = TORCH_COLUMNS

    def weight_operands(self, w_EKN, op):
        """(w in FP8, each expert column-major; its per-column scales [E, N])."""
        if op.tile != "col":
            return super().weight_operands(w_EKN, op)
        return self.columns.weight(w_EKN, op)

    def grouped_mms_with(self, x_RK, ws_operands, offsets_E, scaling, dtype):
        if scaling.a.tile != "row":
            return super().grouped_mms_with(x_RK, ws_operands, offsets_E, scaling, dtype)
        if x_RK.shape[0] == 0:  # no rows (a batch of no tokens padded to a capacity of 0): the kernels take none
            return [x_RK.new_zeros(0, w_fp8.shape[-1], dtype=dtype) for w_fp8, _ in ws_operands]
        x_fp8, scale_R = rows_input(x_RK, scaling.a)
        return [cast(self._rows(x_fp8, w_fp8, scale_R, scale_EN, offsets_E), dtype)
                for w_fp8, scale_EN in ws_operands]

    def grouped_weight_grads(self, x_RK, grads_RN, offsets_E, scaling, dtype):
        if scaling.a.tile != "col":
            return super().grouped_weight_grads(x_RK, grads_RN, offsets_E, scaling, dtype)
        if x_RK.shape[0] == 0:  # a sum over no rows
            return [x_RK.new_zeros(offsets_E.shape[0], x_RK.shape[1], grad_RN.shape[1], dtype=dtype)
                    for grad_RN in grads_RN]
        xT_KR, scale_EK = contract_input(x_RK, offsets_E, scaling.a, self.columns)
        outs = []
        for grad_RN in grads_RN:
            gT_NR, scale_EN = contract_input(grad_RN, offsets_E, scaling.b, self.columns)
            outs.append(cast(self._contract(xT_KR, gT_NR.t(), scale_EK, scale_EN, offsets_E), dtype))
        return outs

    @staticmethod
    def _rows(a_RK, b_EKN, sa_R, sb_EN, offsets_E):
        """bf16 a·b[e(r)] scaled, groups along the rows (b column-major per expert)."""
        return torch._scaled_grouped_mm(a_RK, b_EKN, sa_R, sb_EN, offs=offsets_E, out_dtype=torch.bfloat16)

    @staticmethod
    def _contract(a_MR, b_RN, sa_EM, sb_EN, offsets_E):
        """bf16 a[:, rows e]·b[rows e] scaled per expert, groups along the contraction."""
        return torch._scaled_grouped_mm(a_MR, b_RN, sa_EM, sb_EN, offs=offsets_E, out_dtype=torch.bfloat16)


def _require_triton() -> None:
    """Refuse the Triton backends without the triton package (fp8/triton_grouped.py registers
    their torch.ops.moefold ops when it is imported, above)."""
    if not triton_grouped.HAS_TRITON:
        raise ConfigError("precision.fp8_grouped_gemm=triton needs the triton package, which is not "
                          "installed; use cutlass")


class TritonFp8GroupedGemm(ScaledGroupedMMFp8Gemm):
    """The same FP8 operands and layouts as ScaledGroupedMMFp8Gemm, the GEMMs in Triton
    (fp8/triton_grouped.py) instead of torch's CUTLASS kernel, the column-scaled operands quantized
    by Triton kernels too (fp8/triton_quant.py). Not run in CI:
    tests/gpu/test_fp8_gpu.py compares it with torch's kernel and the emulation."""

    name = "triton"
    columns = TritonColumnQuantizer()

    def __init__(self):
        _require_triton()

    @staticmethod
    def _rows(a_RK, b_EKN, sa_R, sb_EN, offsets_E):
        tile_ends_E = triton_grouped.row_tile_ends(offsets_E)
        return torch.ops.moefold.fp8_grouped_mm_rows(a_RK, b_EKN, sa_R, sb_EN, offsets_E, tile_ends_E)

    @staticmethod
    def _contract(a_MR, b_RN, sa_EM, sb_EN, offsets_E):
        return torch.ops.moefold.fp8_grouped_mm_contract(a_MR, b_RN, sa_EM, sb_EN, offsets_E)


class TritonBlockwiseFp8GroupedGemm(EmulatedFp8GroupedGemm):
    """DeepSeek-V3's blockwise scaling for the experts (1x128 activations, 128x128 weights, 128x1
    along the rows for the weight gradient) in Triton (fp8/triton_grouped.py): torch has no
    blockwise grouped FP8 kernel on Hopper. Quantization as the emulation's, so both multiply the
    same FP8 values; the kernels apply each 128-deep block's scales in fp32."""

    name = "triton-blockwise"

    def __init__(self):
        _require_triton()

    def weight_operands(self, w_EKN, op):
        """(w in FP8, each expert column-major; its 128x128 scales [E, K/128, N/128])."""
        return blockwise_weight(w_EKN, op)

    def grouped_mms_with(self, x_RK, ws_operands, offsets_E, scaling, dtype):
        x_fp8, scale_RKb = blockwise_rows_input(x_RK, scaling.a)
        return [cast(torch.ops.moefold.fp8_grouped_mm_rows_blockwise(x_fp8, w_fp8, scale_RKb, scale_EKbNb,
                                                                     offsets_E), dtype)
                for w_fp8, scale_EKbNb in ws_operands]

    def grouped_weight_grads(self, x_RK, grads_RN, offsets_E, scaling, dtype):
        xT_KR, scale_RbK = blockwise_contract_input(x_RK, scaling.a)
        outs = []
        for grad_RN in grads_RN:
            gT_NR, scale_RbN = blockwise_contract_input(grad_RN, scaling.b)
            out_EKN = torch.ops.moefold.fp8_grouped_mm_contract_blockwise(xT_KR, gT_NR.t(), scale_RbK, scale_RbN,
                                                                          offsets_E)
            outs.append(cast(out_EKN, dtype))
        return outs


def rows_input(x_RK, op: Operand):
    """x in FP8 per row, row-major, as the rows kernels read it: (x_fp8 [R, K], scale [R])."""
    x_fp8, scale_R1 = quantize(x_RK, op)
    return x_fp8, scale_R1.reshape(-1)


def rows_operands(x_RK, w_EKN, scaling: GemmScaling, columns=TORCH_COLUMNS):
    """FP8 operands and fp32 scales of a rows-grouped GEMM (forward, grad_input) in the layout the
    kernels read: x row-major, each expert's w column-major; scales [R] and [E, N]."""
    x_fp8, scale_R = rows_input(x_RK, scaling.a)
    w_fp8, scale_EN = columns.weight(w_EKN, scaling.b)
    return x_fp8, w_fp8, scale_R, scale_EN


def contract_input(x_RK, offsets_E, op: Operand, columns=TORCH_COLUMNS):
    """x^T in FP8, row-major ([K, R'], read along the rows), with its per-group column scales
    flattened to [E·K], as the contraction kernels read them."""
    xT_KR, scale_EK = columns.group_columns_t(x_RK, offsets_E, op)
    return xT_KR, scale_EK.reshape(-1)


def contract_operands(x_RK, grad_RN, offsets_E, scaling: GemmScaling, columns=TORCH_COLUMNS):
    """FP8 operands and fp32 scales of the weight gradient (contraction over each expert's rows):
    x^T row-major, grad column-major, per-group column scales [E·K] and [E·N]."""
    xT_KR, scale_EK = contract_input(x_RK, offsets_E, scaling.a, columns)
    gT_NR, scale_EN = contract_input(grad_RN, offsets_E, scaling.b, columns)
    return xT_KR, gT_NR.t(), scale_EK, scale_EN


def blockwise_rows_input(x_RK, op: Operand):
    """x row-major in FP8 with its 1x128 scales [R, K/128]."""
    x_fp8, scale_RKb = quantize(x_RK, op)
    return x_fp8, scale_RKb.contiguous()


def blockwise_weight(w_EKN, op: Operand):
    """Each expert's w column-major in FP8 with its 128x128 scales [E, K/128, N/128]."""
    w_fp8, scale_EKbNb = quantize(w_EKN, op)
    return column_major(w_fp8), scale_EKbNb.contiguous()


def blockwise_contract_input(x_RK, op: Operand):
    """x^T row-major in FP8 ([K, R'], read along the rows) with the [R'/128, K] scales of its
    128x1 tiles; R padded with zero rows to R' (a multiple of 128, past the last offset: never read)."""
    x_fp8, scale_RbK = quantize(pad_rows(x_RK, BLOCK), op)
    return x_fp8.t().contiguous(), scale_RbK.contiguous()


def blockwise_rows_operands(x_RK, w_EKN, scaling: GemmScaling):
    """x row-major with [R, K/128] scales, each expert's w column-major with [E, K/128, N/128]."""
    x_fp8, scale_RKb = blockwise_rows_input(x_RK, scaling.a)
    w_fp8, scale_EKbNb = blockwise_weight(w_EKN, scaling.b)
    return x_fp8, w_fp8, scale_RKb, scale_EKbNb


def blockwise_contract_operands(x_RK, grad_RN, scaling: GemmScaling):
    """x^T row-major and grad column-major, each with [R'/128, features] scales of its 128x1 tiles."""
    xT_KR, scale_RbK = blockwise_contract_input(x_RK, scaling.a)
    gT_NR, scale_RbN = blockwise_contract_input(grad_RN, scaling.b)
    return xT_KR, gT_NR.t(), scale_RbK, scale_RbN


class HighPrecisionGroupedWeightGrad:
    """`precision.fp8_weight_grad=bf16` for the experts: forward and grad_input through `inner` in
    FP8, each expert's weight gradient a plain `torch._grouped_mm` in the compute dtype — no
    per-group column scaling, no transposed FP8 copies of x and grad."""

    def __init__(self, inner: EmulatedFp8GroupedGemm):
        self.inner = inner
        self.name = f"{inner.name}, bf16 grad_weight"

    def grouped_mm(self, x_RK, w_EKN, offsets_E, scaling, dtype):
        return self.inner.grouped_mm(x_RK, w_EKN, offsets_E, scaling, dtype)

    def grouped_mms(self, x_RK, ws_EKN, offsets_E, scaling, dtype):
        return self.inner.grouped_mms(x_RK, ws_EKN, offsets_E, scaling, dtype)

    def weight_operands(self, w_EKN, op):
        return self.inner.weight_operands(w_EKN, op)

    def grouped_mms_with(self, x_RK, ws_operands, offsets_E, scaling, dtype):
        return self.inner.grouped_mms_with(x_RK, ws_operands, offsets_E, scaling, dtype)

    def grouped_weight_grad(self, x_RK, grad_RN, offsets_E, scaling, dtype):
        return cast(grouped_mm(x_RK.t(), grad_RN, offsets_E), dtype)

    def grouped_weight_grads(self, x_RK, grads_RN, offsets_E, scaling, dtype):
        return [self.grouped_weight_grad(x_RK, grad_RN, offsets_E, scaling, dtype) for grad_RN in grads_RN]


def build_grouped_gemm(device_type: str, kernel: str = "triton", weight_grad: str = "fp8",
                       recipe: str = "rowwise", emulate: bool = False):
    """The backend for `precision.fp8_grouped_gemm` and recipe on this device (the emulation off
    CUDA or when `precision.fp8_emulate` asks), its weight gradient as `precision.fp8_weight_grad`
    says. Blockwise has a kernel in Triton only: with `cutlass` it runs the emulation."""
    if device_type != "cuda" or emulate:
        gemm = EmulatedFp8GroupedGemm()
    elif kernel == "triton":
        gemm = TritonBlockwiseFp8GroupedGemm() if recipe == "blockwise" else TritonFp8GroupedGemm()
    else:
        gemm = ScaledGroupedMMFp8Gemm()
    return HighPrecisionGroupedWeightGrad(gemm) if weight_grad == "bf16" else gemm


class _Fp8GroupedMMFn(torch.autograd.Function):
    """x·w per group, and x·w2 when given (gate and up read the same x): x is quantized once for
    the forward GEMMs and once for the weight gradients, and kept once for the backward.

    The weights' FP8 operands come from `cached` when given (`CachedWeights.operands, fp8/weight_cache.py`:
    the forward's and grad_input's, quantized once per optimizer step), else each GEMM quantizes
    its weight when it runs: the forward's here, grad_input's in the backward from the kept w.

    Two weight parameters, not `*ws`: without grad, Dynamo (torch 2.11-2.13) inlines `forward` and
    drops ctx whenever the argument count equals the signature's length (its test for a forward
    without ctx, pytorch#137809), which a variadic forward meets with two weights."""

    @staticmethod
    def forward(ctx, x_RK, offsets_E, gemm, scaling: Fp8Scaling, saver: SaveInput, cached, w_EKN, w2_EKN=None):
        ws_EKN = [w_EKN] if w2_EKN is None else [w_EKN, w2_EKN]
        if cached is None:
            forward_operands = [gemm.weight_operands(w, scaling.forward.b) for w in ws_EKN]
            kept = ws_EKN  # grad_input quantizes their transposes in the backward
        else:
            forward_operands, grad_input_operands = cached
            kept = [t for operands in grad_input_operands for t in operands]
        packed = saver.pack(x_RK)
        ctx.save_for_backward(offsets_E, *kept, *packed)
        ctx.gemm, ctx.scaling, ctx.saver, ctx.x_dtype = gemm, scaling, saver, x_RK.dtype
        ctx.num_weights, ctx.num_kept, ctx.cached = len(ws_EKN), len(kept), cached is not None
        ctx.w_dtype = w_EKN.dtype
        return tuple(gemm.grouped_mms_with(x_RK, forward_operands, offsets_E, scaling.forward, x_RK.dtype))

    @staticmethod
    def backward(ctx, *grads_RN):
        offsets_E, *saved = ctx.saved_tensors
        kept, packed = saved[:ctx.num_kept], saved[ctx.num_kept:]
        gemm, scaling = ctx.gemm, ctx.scaling
        x_RK = ctx.saver.unpack(packed, ctx.x_dtype)
        grads_RN = [grad_RN.to(x_RK.dtype) for grad_RN in grads_RN]
        grad_x_RK = None
        if ctx.needs_input_grad[0]:
            # Summed in the compute dtype, as autograd sums the gradients of an input read twice.
            for i, grad_RN in enumerate(grads_RN):
                part_RK = gemm.grouped_mms_with(grad_RN, [_grad_input_operands(ctx, kept, i)], offsets_E,
                                                scaling.grad_input, x_RK.dtype)[0]
                grad_x_RK = part_RK if grad_x_RK is None else grad_x_RK + part_RK
        grad_ws_EKN = [None, None]
        wanted = [i for i in range(ctx.num_weights) if ctx.needs_input_grad[6 + i]]
        if wanted:
            grads = gemm.grouped_weight_grads(x_RK, [grads_RN[i] for i in wanted], offsets_E,
                                              scaling.grad_weight, ctx.w_dtype)
            for i, grad_w_EKN in zip(wanted, grads):
                grad_ws_EKN[i] = grad_w_EKN
        return grad_x_RK, None, None, None, None, None, *grad_ws_EKN


def _grad_input_operands(ctx, kept, i: int) -> tuple[torch.Tensor, ...]:
    """Weight i's operands of grad_input (w^T): cached, or quantized now from the kept w (one
    weight at a time, so that one FP8 copy lives at once)."""
    if ctx.cached:
        per_weight = ctx.num_kept // ctx.num_weights
        return tuple(kept[i * per_weight:(i + 1) * per_weight])
    return ctx.gemm.weight_operands(kept[i].transpose(-2, -1), ctx.scaling.grad_input.b)


def fp8_grouped_mms(x_RK: torch.Tensor, ws_EKN: list[torch.Tensor], offsets_E: torch.Tensor,
                    gemm: EmulatedFp8GroupedGemm, scaling: Fp8Scaling,
                    saver: SaveInput | None = None, cached=None) -> list[torch.Tensor]:
    """[torch._grouped_mm(x, w, offs) for w in ws] (one or two weights: gate and up) with FP8
    operands in forward and backward, x quantized once for all of them (forward and weight
    gradients) and kept for the backward once, as `saver` says (fp8/saved.py; by default as it
    is). Equal, bit for bit, to one fp8_grouped_mm per weight. `cached`: the weights' FP8
    operands, quantized beforehand (`CachedWeights.operands, fp8/weight_cache.py`); None quantizes them here."""
    if len(ws_EKN) not in (1, 2):
        raise ValueError(f"fp8_grouped_mms takes one or two weights, got {len(ws_EKN)}")
    saver = kept_for_backward(saver or SaveInput())
    return list(_Fp8GroupedMMFn.apply(x_RK, offsets_E, gemm, scaling, saver, cached, *ws_EKN))


def fp8_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor,
                   gemm: EmulatedFp8GroupedGemm, scaling: Fp8Scaling,
                   saver: SaveInput | None = None, cached=None) -> torch.Tensor:
    """torch._grouped_mm(x, w, offs) with FP8 operands in forward and backward; x is kept for the
    backward as `saver` says (fp8/saved.py; by default as it is); `cached` as fp8_grouped_mms'."""
    return fp8_grouped_mms(x_RK, [w_EKN], offsets_E, gemm, scaling, saver, cached)[0]


__all__ = [
    "EmulatedFp8GroupedGemm",
    "HighPrecisionGroupedWeightGrad",
    "ScaledGroupedMMFp8Gemm",
    "TritonBlockwiseFp8GroupedGemm",
    "TritonFp8GroupedGemm",
    "build_grouped_gemm",
    "fp8_grouped_mm",
    "fp8_grouped_mms",
    "grouped_scaling",
]
