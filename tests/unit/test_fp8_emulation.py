"""The CPU emulation of the FP8 recipes (moefold.fp8) against fp64 references.

Legend: M rows, K contraction dim, N output features, E experts, R routed rows.

Error model, for a normal value quantized with the right scale s: the FP8 value rounds to nearest
with a relative error of at most u = 2^-(mantissa bits + 1): 2^-4 for e4m3, 2^-3 for e5m2. Below
the smallest normal (2^-6 for e4m3, 2^-14 for e5m2, in scaled units) the error is absolute, at most
half the subnormal spacing times s: tau*s with tau = 2^-10 (e4m3), 2^-17 (e5m2).
"""

import pytest
import torch

from moefold.fp8 import E4M3, E5M2, emulated_grouped_mm, emulated_mm, make_recipe
from moefold.fp8.recipes import dequantize_tiles

RECIPES = ["tensorwise", "rowwise", "blockwise"]
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
BF16_U = 2.0 ** -8  # unit roundoff of bf16 (8-bit significand)


def outlier_tensor(shape, seed, outlier_frac=0.01, outlier_scale=1e3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) < outlier_frac
    return torch.where(mask, x * outlier_scale, x)


def expanded_scale(recipe, x, operand):
    """The scale each element of x was quantized with, broadcast to x's shape."""
    _, scale = recipe.quantize(x, operand)
    ones = torch.ones(x.shape).to(recipe.fmt.dtype)
    return dequantize_tiles(ones, scale, torch.float64)


def elementwise_quant_error_bound(recipe, x, operand, extra_rel=0.0):
    """|dequant(quant(x)) - x| <= u|x| + tau*s, widened by a later cast of relative error extra_rel."""
    fmt = recipe.fmt
    s = expanded_scale(recipe, x, operand)
    x64 = x.double().abs()
    u = fmt.unit_roundoff
    bound = u * x64 + fmt.subnormal_abs_error * s
    return bound * (1 + extra_rel) + extra_rel * x64 + 1e-6 * bound  # 1e-6: fp32 division of x / s


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("operand", ["activation", "weight"])
def test_round_trip_within_rounding_error(name, fmt, operand):
    recipe = make_recipe(name, fmt)
    x = outlier_tensor((256, 384), seed=0)
    x_fp8, scale = recipe.quantize(x, operand)
    assert x_fp8.dtype == FORMATS[fmt].dtype
    back = recipe.dequantize(x_fp8, scale, torch.float64)
    err = (back - x.double()).abs()
    assert (err <= elementwise_quant_error_bound(recipe, x, operand)).all()
    # Every tile uses the format's full range: its amax lands exactly on fp8_max.
    tile_max = dequantize_tiles(x_fp8.float().abs().to(recipe.fmt.dtype), torch.ones_like(scale))
    assert tile_max.max() == recipe.fmt.max


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", RECIPES)
def test_zero_and_constant_tensors(name, fmt):
    recipe = make_recipe(name, fmt)
    zeros = torch.zeros(128, 256)
    x_fp8, scale = recipe.quantize(zeros)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(recipe.dequantize(x_fp8, scale), zeros)
    for value in (3.7, -1e-20, 6e4):
        const = torch.full((128, 256), value)
        for operand in ("activation", "weight"):
            back = recipe.dequantize(*recipe.quantize(const, operand))
            torch.testing.assert_close(back, const, rtol=1e-6, atol=0)


def gemm_error_bound(recipe, a_MK, b_KN):
    """Elementwise bound on |emulated_mm(a, b) - a @ b| (all terms in fp64).

    e_a, e_b: per-element quantization error (u|x| + tau*s) widened by the bf16 cast of the
    dequantized value (relative 2^-8). The product error is |a| e_b + e_a |b| + e_a e_b; fp32
    accumulation adds at most K 2^-24 (|a|+e_a)(|b|+e_b); rounding the output to bf16 adds
    2^-8 |C_ref| plus 2^-8 of the error so far.
    """
    e_a = elementwise_quant_error_bound(recipe, a_MK, "activation", extra_rel=BF16_U)
    e_b = elementwise_quant_error_bound(recipe, b_KN, "weight", extra_rel=BF16_U)
    abs_a, abs_b = a_MK.double().abs(), b_KN.double().abs()
    product = abs_a @ e_b + e_a @ abs_b + e_a @ e_b
    accumulate = a_MK.shape[1] * 2.0 ** -24 * ((abs_a + e_a) @ (abs_b + e_b))
    c_ref = (a_MK.double() @ b_KN.double()).abs()
    return (product + accumulate) * (1 + BF16_U) + BF16_U * c_ref


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", RECIPES)
def test_emulated_mm_within_derived_bound(name, fmt):
    recipe = make_recipe(name, fmt)
    a_MK, b_KN = outlier_tensor((96, 512), seed=1), outlier_tensor((512, 256), seed=2) * 0.05
    c_ref = a_MK.double() @ b_KN.double()
    c = emulated_mm(a_MK, b_KN, recipe)
    assert c.dtype == torch.bfloat16
    err = (c.double() - c_ref).abs()
    bound = gemm_error_bound(recipe, a_MK, b_KN)
    assert (err <= bound).all(), f"worst err/bound {(err / bound).max():.3f}"
    # The bound is not vacuous: the typical element uses a fair share of it.
    assert (err / bound).median() > 0.01


def median_relative_error(c, a_MK, b_KN):
    """Median of |C - C_ref| / |C_ref|: each output element weighs the same whatever its magnitude."""
    ref = a_MK.double() @ b_KN.double()
    return ((c.double() - ref).abs() / ref.abs()).median().item()


def test_rowwise_beats_tensorwise_on_per_row_magnitudes():
    g = torch.Generator().manual_seed(3)
    rows_M1 = 2.0 ** -torch.randint(0, 24, (128, 1), generator=g).float()
    cols_1N = 2.0 ** -torch.randint(0, 24, (1, 256), generator=g).float()
    a_MK = torch.randn(128, 256, generator=g) * rows_M1
    b_KN = torch.randn(256, 256, generator=g) * cols_1N
    errors = {n: median_relative_error(emulated_mm(a_MK, b_KN, make_recipe(n)), a_MK, b_KN) for n in RECIPES}
    # Blockwise is not in this race: its 128x128 weight blocks share one scale across columns.
    assert errors["rowwise"] * 4 < errors["tensorwise"], errors


def test_blockwise_beats_rowwise_and_tensorwise_on_per_block_magnitudes():
    """Outliers confined to K-blocks: activation block t scaled 2^-6t, weight block t 2^+6t, so each
    K-block contributes equally to C but one scale per row/column flushes the small blocks."""
    g = torch.Generator().manual_seed(4)
    k_blocks = 4
    block_K = torch.repeat_interleave(2.0 ** (6 * torch.arange(k_blocks).float()), 128)
    a_MK = torch.randn(64, 128 * k_blocks, generator=g) / block_K
    b_KN = torch.randn(128 * k_blocks, 256, generator=g) * block_K[:, None]
    errors = {n: median_relative_error(emulated_mm(a_MK, b_KN, make_recipe(n)), a_MK, b_KN) for n in RECIPES}
    assert errors["blockwise"] * 4 < errors["rowwise"], errors
    assert errors["blockwise"] * 4 < errors["tensorwise"], errors


def test_blockwise_rejects_unaligned_shapes():
    recipe = make_recipe("blockwise")
    with pytest.raises(ValueError, match="200 columns.*multiple of 128"):
        recipe.quantize(torch.randn(4, 200))
    with pytest.raises(ValueError, match="blockwise activation has 200 columns"):
        emulated_mm(torch.randn(4, 200), torch.randn(200, 128), recipe)
    with pytest.raises(ValueError, match="100 columns"):
        emulated_mm(torch.randn(4, 128), torch.randn(128, 100), recipe)
    with pytest.raises(ValueError, match="emulated_mm needs"):
        emulated_mm(torch.randn(4, 128), torch.randn(256, 128), recipe)
    with pytest.raises(ValueError, match="allowed"):
        make_recipe("mxfp8")
    with pytest.raises(ValueError, match="operand"):
        recipe.quantize(torch.randn(4, 128), "gradient")


def loop_reference(x_RK, w_EKN, ends, recipe):
    out = torch.zeros(x_RK.shape[0], w_EKN.shape[2], dtype=torch.bfloat16)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = emulated_mm(x_RK[start:end], w_EKN[e], recipe)
        start = end
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_grouped_equals_per_group_loop(name, fmt):
    recipe = make_recipe(name, fmt)
    x_RK = outlier_tensor((50, 256), seed=5)
    w_EKN = outlier_tensor((4, 256, 128), seed=6)
    ends = [7, 7, 30, 45]  # an empty expert, and 5 unused rows at the end
    got = emulated_grouped_mm(x_RK, w_EKN, torch.tensor(ends), recipe)
    torch.testing.assert_close(got, loop_reference(x_RK, w_EKN, ends, recipe), rtol=0, atol=0)
    assert (got[45:] == 0).all()


def test_grouped_rejects_tensorwise_and_bad_shapes():
    with pytest.raises(ValueError, match="tensorwise"):
        emulated_grouped_mm(torch.randn(8, 128), torch.randn(2, 128, 128), torch.tensor([4, 8]),
                            make_recipe("tensorwise"))
    with pytest.raises(ValueError, match="offsets_E"):
        emulated_grouped_mm(torch.randn(8, 128), torch.randn(2, 128, 128), torch.tensor([8]),
                            make_recipe("rowwise"))


@pytest.mark.parametrize("shape", [(128, 1), (1, 64), (3, 128, 1), (5, 7)])
def test_column_major_strides_are_exact_along_a_dim_of_one(shape):
    """cuBLAS checks a blockwise scale's strides exactly: a's [M, 1] 1x128 scales (K = 128) must
    read (1, M), which `.t().contiguous().t()` leaves (1, 1) (torch's contiguity ignores a dim of
    size 1); blockwise FP8 at dim 128 crashed on the GPU ('scale_a strides must be (1, 128)')."""
    from moefold.fp8.gemm import column_major

    x = torch.randn(shape)
    out = column_major(x)
    rows, cols = shape[-2:]
    assert torch.equal(out, x) and out.stride()[-2:] == (1, rows)
    assert column_major(out) is out  # already column-major: no copy
