"""FP8 GEMMs of training: how each recipe scales the three GEMMs of a linear layer, and the backends
that run them (chosen once, when the model is built).

M tokens, K input features, N output features, R routed rows (grouped by expert), E experts.

A linear `y_MN = x_MK @ W_NK^T` needs three GEMMs per step, each `a @ b` with FP8 operands:

| GEMM          | a                  | b              |
|---------------|--------------------|----------------|
| `forward`     | x_MK               | W^T (b_KN)     |
| `grad_input`  | grad_y_MN          | W_NK           |
| `grad_weight` | grad_y^T (a_NM)    | x_MK           |

Each operand has a tile kind (which elements share a scale: recipes.TILE_KINDS) and a format:

| recipe     | forward a, b        | grad_input a, b          | grad_weight a, b          | grads |
|------------|---------------------|--------------------------|---------------------------|-------|
| tensorwise | tensor, tensor      | tensor (e5m2), tensor    | tensor (e5m2), tensor     | e5m2  |
| rowwise    | row, col            | row, col                 | row, col                  | e4m3  |
| blockwise  | 1x128, 128x128      | 1x128, 128x128           | 1x128, 128x1              | e4m3  |

Tensorwise keeps torchao's default of e5m2 gradients (one scale per tensor has to cover the
gradients' range); rowwise and blockwise use e4m3 everywhere, as torchao's rowwise recipe and
DeepSeek-V3 (arXiv:2412.19437 §3.3) do, since their fine scales already capture the range.
In `grad_weight` the contraction runs over tokens, so blockwise tiles run along M (1x128 of a_NM,
128x1 of x_MK): M is padded with zero rows to `Fp8Scaling.row_multiple` first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moefold.dtypes import cast
from moefold.fp8.recipes import BLOCK, E5M2, Operand, fake_quant, quantize


@dataclass(frozen=True)
class GemmScaling:
    """How the two operands of one `a @ b` are quantized."""
    a: Operand
    b: Operand


@dataclass(frozen=True)
class Fp8Scaling:
    """One recipe's scaling of the three GEMMs (forward, grad_input, grad_weight) of a linear (module
    docstring table) or of the routed experts' grouped GEMMs (grouped.py)."""
    name: str
    forward: GemmScaling
    grad_input: GemmScaling
    grad_weight: GemmScaling
    row_multiple: int
    """Tokens are padded to this for grad_weight (the FP8 kernels' alignment along the contraction),
    and each expert's rows to it when the experts run in FP8."""


def linear_scaling(recipe: str) -> Fp8Scaling:
    if recipe == "tensorwise":
        t, t5 = Operand("tensor"), Operand("tensor", E5M2)
        return Fp8Scaling(recipe, GemmScaling(t, t), GemmScaling(t5, t), GemmScaling(t5, t), 16)
    if recipe == "rowwise":
        rc = GemmScaling(Operand("row"), Operand("col"))
        return Fp8Scaling(recipe, rc, rc, rc, 16)
    if recipe == "blockwise":
        fwd = GemmScaling(Operand("1x128"), Operand("128x128"))
        return Fp8Scaling(recipe, fwd, fwd, GemmScaling(Operand("1x128"), Operand("128x1")), BLOCK)
    raise ValueError(f"precision.fp8={recipe!r} has no linear scaling; allowed: tensorwise, rowwise, blockwise")


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of `multiple` (zero rows add nothing to a^T b)."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def column_major(x: torch.Tensor) -> torch.Tensor:
    """x with its last two dims column-major (stride 1 down the rows, R between columns), as
    cuBLAS and the FP8 grouped kernels read b and some scales: a copy unless x already is. The
    strides are exact also along a dim of size 1, which torch's contiguity ignores but cuBLAS's
    blockwise scale checks do not (an [M, 1] scale of K = 128: 'scale_a strides must be (1, M)')."""
    *batch, rows, cols = x.shape
    out = x.new_empty((*batch, cols, rows)).transpose(-2, -1)
    if x.stride() == out.stride():
        return x
    return out.copy_(x)


class Fp8GemmBase:
    """What every linear backend shares: the weight gradient as one more FP8 GEMM."""

    name = "base"

    def mm(self, a_MK: torch.Tensor, b_KN: torch.Tensor, scaling: GemmScaling,
           dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def weight_grad(self, grad_MN: torch.Tensor, x_MK: torch.Tensor, scaling: Fp8Scaling,
                    dtype: torch.dtype) -> torch.Tensor:
        """grad_W_NK = grad_y^T x: the contraction runs over tokens, padded with zero rows to the
        kernels' alignment."""
        m = scaling.row_multiple
        return self.mm(pad_rows(grad_MN, m).t(), pad_rows(x_MK, m), scaling.grad_weight, dtype)


class EmulatedFp8Gemm(Fp8GemmBase):
    """quantize → dequantize → matmul in the compute dtype (recipes.py); runs on any device."""

    name = "emulated"

    def mm(self, a_MK: torch.Tensor, b_KN: torch.Tensor, scaling: GemmScaling,
           dtype: torch.dtype) -> torch.Tensor:
        return fake_quant(a_MK, scaling.a, dtype) @ fake_quant(b_KN, scaling.b, dtype)


class ScaledMMFp8Gemm(Fp8GemmBase):
    """cuBLAS FP8 GEMMs: `torch._scaled_mm` for tensorwise/rowwise scales, `F.scaled_mm` with
    DeepSeek blockwise scales (cuBLAS ≥ 12.9 on sm90). Not run in CI: tests/gpu/test_fp8_gpu.py
    compares it with EmulatedFp8Gemm.

    cuBLAS wants a row-major, b column-major, K and N multiples of 16, and the dequantization
    multipliers our recipes store as scales. Rowwise scaling only outputs bf16.
    """

    name = "scaled_mm"

    def mm(self, a_MK, b_KN, scaling, dtype):
        if a_MK.numel() == 0 or b_KN.numel() == 0:  # no tokens: no scale to hand cuBLAS; a sum of none is 0
            return a_MK.new_zeros(a_MK.shape[0], b_KN.shape[1], dtype=dtype)
        a_fp8, scale_a = quantize(a_MK, scaling.a)
        b_fp8, scale_b = quantize(b_KN, scaling.b)
        a_fp8 = a_fp8.contiguous()  # row-major (grad_weight's a is a transposed view)
        b_fp8 = column_major(b_fp8)
        kinds = (scaling.a.tile, scaling.b.tile)
        if kinds == ("tensor", "tensor"):
            out = torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                                   out_dtype=dtype)
        elif kinds == ("row", "col"):
            out = torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a.contiguous(),
                                   scale_b=scale_b.contiguous(), out_dtype=torch.bfloat16)
        else:
            out = self._blockwise(a_fp8, scale_a, b_fp8, scale_b, kinds)
        return cast(out, dtype)

    @staticmethod
    def _blockwise(a_fp8, scale_a, b_fp8, scale_b, kinds):
        if kinds[0] != "1x128" or kinds[1] not in ("128x128", "128x1"):
            raise ValueError(f"ScaledMMFp8Gemm: no cuBLAS kernel for tiles {kinds}")
        return torch.ops.moefold.scaled_mm_blockwise(a_fp8, scale_a, b_fp8, scale_b, kinds[1])


@torch.library.custom_op("moefold::scaled_mm_blockwise", mutates_args=())
def scaled_mm_blockwise(a_fp8: torch.Tensor, scale_a: torch.Tensor, b_fp8: torch.Tensor,
                        scale_b: torch.Tensor, b_tile: str) -> torch.Tensor:
    """bf16 a_MK·b_KN with DeepSeek's scales (a: 1x128 [M, K/128]; b: "128x128" [K/128, N/128] or
    "128x1" [K/128, N]) through cuBLAS (`F.scaled_mm`). An opaque op to torch.compile: Dynamo
    cannot trace torch 2.11's F.scaled_mm, and a graph break there would leave every quantization
    around the blockwise linears eager."""
    st = F.ScalingType
    # cuBLAS reads every blockwise scale outer-dim-major: a's 1x128 scales as [M, K/128] with
    # stride 1 along M; b's 128x1 scales as [N, K/128] with stride 1 along N; b's 128x128 scales
    # as [K/128, N/128] with stride 1 along K/128, K/128 padded to a multiple of 4.
    scale_a = column_major(scale_a)
    if b_tile == "128x128":
        kb = scale_b.shape[0]
        scale_b = column_major(F.pad(scale_b, (0, 0, 0, -kb % 4), value=1.0))
        recipe_b = st.BlockWise128x128
    else:
        scale_b, recipe_b = scale_b.t(), st.BlockWise1x128
    return F.scaled_mm(a_fp8.contiguous(), column_major(b_fp8), scale_a, st.BlockWise1x128,
                       scale_b, recipe_b, output_dtype=torch.bfloat16)


@scaled_mm_blockwise.register_fake
def _(a_fp8, scale_a, b_fp8, scale_b, b_tile):
    return a_fp8.new_empty(a_fp8.shape[0], b_fp8.shape[1], dtype=torch.bfloat16)


class HighPrecisionWeightGrad(Fp8GemmBase):
    """`precision.fp8_weight_grad=bf16`: forward and grad_input through `inner` in FP8, the weight
    gradient unquantized in the compute dtype (torchao's "rowwise_with_gw_hp"). The weight gradient
    is the GEMM most sensitive to FP8 and, for the routed experts, the costliest to quantize (per
    column within each expert's rows, two transposed operands)."""

    def __init__(self, inner: Fp8GemmBase):
        self.inner = inner
        self.name = f"{inner.name}, bf16 grad_weight"

    def mm(self, a_MK, b_KN, scaling, dtype):
        return self.inner.mm(a_MK, b_KN, scaling, dtype)

    def weight_grad(self, grad_MN, x_MK, scaling, dtype):
        return cast(grad_MN.t() @ x_MK, dtype)


def build_gemm(device_type: str, weight_grad: str = "fp8", emulate: bool = False) -> Fp8GemmBase:
    """The FP8 GEMM backend for a device: cuBLAS on CUDA, the emulation elsewhere or when asked
    (`precision.fp8_emulate`); the weight gradient in FP8 or in the compute dtype
    (`precision.fp8_weight_grad`)."""
    gemm = ScaledMMFp8Gemm() if device_type == "cuda" and not emulate else EmulatedFp8Gemm()
    return HighPrecisionWeightGrad(gemm) if weight_grad == "bf16" else gemm
