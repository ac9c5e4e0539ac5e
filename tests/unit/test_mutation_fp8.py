"""Tests that kill mutants of the FP8 CPU path (moefold.fp8, optim/blocks.py) that the other FP8
tests let through: each compares with an fp64 reference written here from the recipes' definitions,
with the formats' constants written out (e4m3: max 448; e5m2: max 57344), sharing nothing with
recipes.py but the torch FP8 dtypes.

M tokens, K input features, N output features, E experts, R routed rows.
"""

import pytest
import torch

from moefold.fp8.recipes import E4M3, E5M2, Operand, quantize

# The formats by their definition (OCP FP8: e4m3fn's largest finite value 1.75 · 2^8, e5m2's 1.75 · 2^15).
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
FMT = {"e4m3": E4M3, "e5m2": E5M2}
# Tile (rows, cols) of each kind over the last two dims; 0 = the whole dim.
TILES = {"tensor": (0, 0), "row": (1, 0), "col": (0, 1), "1x128": (1, 128), "128x1": (128, 1),
         "128x128": (128, 128)}


def ref_quantize(x, tile, fmt_name):
    """(FP8 values as fp64, per-tile scales in fp64): scale = amax / fp8_max (1 for an all-zero
    tile), x / scale clamped to ±fp8_max and cast, one tile at a time."""
    dtype, fp8_max = FORMATS[fmt_name]
    x64 = x.double()
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    q = torch.empty_like(x64)
    scale = torch.empty(rows // tr, cols // tc, dtype=torch.float64)
    for i in range(0, rows, tr):
        for j in range(0, cols, tc):
            t = x64[i:i + tr, j:j + tc]
            amax = t.abs().max().item()
            s = amax / fp8_max if amax > 0 else 1.0
            scale[i // tr, j // tc] = s
            q[i:i + tr, j:j + tc] = (t / s).clamp(-fp8_max, fp8_max).to(dtype).double()
    return q, scale


def ref_fake_quant(x, tile, fmt_name):
    """ref_quantize dequantized, in fp64."""
    q, s = ref_quantize(x, tile, fmt_name)
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    return q * s.repeat_interleave(tr, 0).repeat_interleave(tc, 1)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- recipes.py: the formats


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("kind", list(TILES))
def test_each_tiles_amax_lands_on_the_formats_written_out_max(kind, fmt_name):
    """Every tile's scale is amax / 448 (e4m3) or amax / 57344 (e5m2), so each tile's largest
    value becomes exactly that maximum: a format whose max were off (49152 for e5m2) would still
    agree with references that read the max from the format object."""
    x = randn((256, 256), 0) * torch.exp2(torch.randint(-8, 9, (256, 1), generator=torch.Generator().manual_seed(1)))
    x_fp8, scale = quantize(x, Operand(kind, FMT[fmt_name]))
    q_ref, scale_ref = ref_quantize(x, TILES[kind], fmt_name)
    assert x_fp8.dtype == FORMATS[fmt_name][0]
    assert FMT[fmt_name].max == FORMATS[fmt_name][1] == torch.finfo(FORMATS[fmt_name][0]).max
    torch.testing.assert_close(scale.double(), scale_ref, rtol=2 ** -22, atol=0)
    assert x_fp8.double().abs().max().item() == FORMATS[fmt_name][1]
    assert (x_fp8.double() != q_ref).double().mean() < 1e-3  # ties within fp32's rounding of x / scale

