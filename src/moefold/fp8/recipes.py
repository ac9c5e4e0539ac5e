"""FP8 scaling recipes, emulated in plain PyTorch so their numerics can be tested on CPU.

Legend: M rows of the activation (tokens), K contraction dim, N output features, E experts,
R routed rows (all experts' rows, grouped by expert), Bm/Bk/Bn counts of scale blocks along M/K/N.

Every recipe is the same operation with a different tile shape: split the operand into tiles, take
each tile's amax, store `scale = amax · (1 / fp8_max)` (the *dequantization* multiplier, as
`torch._scaled_mm` takes it) and cast `x / scale`, clamped to ±fp8_max, to FP8. The operands of
`a_MK @ b_KN` are tiled as follows.

| recipe       | activation `a_MK` tile | scale shape  | weight `b_KN` tile | scale shape  |
|--------------|------------------------|--------------|--------------------|--------------|
| `tensorwise` | M×K                    | [1, 1]       | K×N                | [1, 1]       |
| `rowwise`    | 1×K (per row)          | [M, 1]       | K×1 (per column)   | [1, N]       |
| `blockwise`  | 1×128 (DeepSeek-V3)    | [M, K/128]   | 128×128            | [K/128, N/128] |

Rowwise matches the scale shapes of `torch._scaled_mm`'s rowwise recipe; blockwise is DeepSeek-V3's
fine-grained quantization (arXiv:2412.19437, §3.3.2). Blockwise needs K and N to be multiples of 128
and raises otherwise rather than padding: the FP8 kernels need the same alignment, and padding is
the caller's job (the MoE layer pads per-expert rows; model dims are chosen aligned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

BLOCK = 128
"""Side of DeepSeek-V3's quantization tiles (1×128 activations, 128×128 weights)."""


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its torch dtype, largest finite value and explicit mantissa bits."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exp: int
    """Exponent of the smallest normal number (values below it are subnormal)."""

    @property
    def inv_max(self) -> float:
        """1 / max, which fp32 does not hold exactly (448 = 7 · 2^6): a tensor op rounds it to
        fp32, for 448 and 57344 the bits of fp32's 1.0f / max, the reciprocal CUDA's division by
        a scalar multiplies with. Scales are `amax * inv_max`, the same bits on every device and in
        the Triton kernels (torch on CUDA divides by a Python scalar this way; on the CPU it
        divides, which can differ in the last bit)."""
        return 1.0 / self.max

    @property
    def unit_roundoff(self) -> float:
        """Largest relative rounding error for a normal value: 2^-(mantissa_bits + 1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def subnormal_abs_error(self) -> float:
        """Largest absolute rounding error (in scaled units) below the smallest normal."""
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, mantissa_bits=3, min_normal_exp=-6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, mantissa_bits=2, min_normal_exp=-14)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _check_tiles(x: torch.Tensor, tile: tuple[int, int], what: str) -> None:
    rows, cols = x.shape[-2:]
    for dim, size, step in (("rows", rows, tile[0]), ("columns", cols, tile[1])):
        if size % step:
            raise ValueError(f"{what} has {size} {dim} ({tuple(x.shape)}), not a multiple of the "
                             f"{tile[0]}x{tile[1]} quantization tile; pad it to a multiple of {step}")


def tile_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Each tile's dequantization multiplier, amax · (1 / fp8_max); 1 where that is 0: an all-zero
    tile, or an fp32 amax below fp8_max · 2^-150, whose scale underflows (its zeros would be 0 / 0)."""
    scale = amax * fmt.inv_max
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_tiles(x: torch.Tensor, tile: tuple[int, int], fmt: Fp8Format,
                   what: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dims of `x` in `tile`-shaped tiles; returns (x_fp8, scale).

    `scale` has shape `[..., rows / tile[0], cols / tile[1]]` and holds amax / fp8_max per tile
    (1 where a tile is all zeros or its scale underflows, so nothing divides by zero).
    """
    if x.dim() < 2:
        raise ValueError(f"{what} must have at least 2 dims, got shape {tuple(x.shape)}")
    _check_tiles(x, tile, what)
    *batch, rows, cols = x.shape
    br, bc = tile
    tiles = x.float().reshape(*batch, rows // br, br, cols // bc, bc)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = tile_scale(amax, fmt)
    # Saturate: x / scale can land a rounding step above fp8_max, and e4m3fn has no inf to absorb it.
    x_fp8 = (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    return x_fp8, scale.reshape(*batch, rows // br, cols // bc)


def dequantize_tiles(x_fp8: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_tiles`: each tile times its scale, computed in fp32, returned in dtype."""
    *batch, rows, cols = x_fp8.shape
    br, bc = (size // tiles if tiles else 1  # an empty dim (no tokens) has no tiles
              for size, tiles in zip((rows, cols), scale.shape[-2:]))
    tiles = x_fp8.float().reshape(*batch, rows // br, br, cols // bc, bc)
    out = tiles * scale.reshape(*batch, rows // br, 1, cols // bc, 1)
    return out.reshape(x_fp8.shape).to(dtype)


TILE_KINDS = ("tensor", "row", "col", "1x128", "128x1", "128x128")


def tile_shape(kind: str, x: torch.Tensor) -> tuple[int, int]:
    """The tile of `kind` for the last two dims of x ("row": one scale per row, "col": per column);
    along an empty dim (a batch of no tokens) a side of 1, which gives no tiles."""
    rows, cols = (max(size, 1) for size in x.shape[-2:])
    shapes = {"tensor": (rows, cols), "row": (1, cols), "col": (rows, 1),
              "1x128": (1, BLOCK), "128x1": (BLOCK, 1), "128x128": (BLOCK, BLOCK)}
    return shapes[kind]


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized: its tile kind and FP8 format."""
    tile: str
    fmt: Fp8Format = E4M3


def quantize(x: torch.Tensor, op: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_tiles(x, tile_shape(op.tile, x), op.fmt, what=f"{op.tile} {op.fmt.name} operand")


def fake_quant(x: torch.Tensor, op: Operand, dtype: torch.dtype) -> torch.Tensor:
    """quantize → dequantize: the values an FP8 GEMM multiplies, in dtype."""
    return dequantize_tiles(*quantize(x, op), dtype=dtype)


class Recipe:
    """A scaling strategy of `a_MK @ b_KN`: the tile kind (TILE_KINDS) of the activation and of the
    weight, both in one format.

    Subclasses set only `name` and the two kinds; `quantize`/`dequantize` are shared.
    `operand="activation"` means the contraction dim is last (`a_MK`), `"weight"` that it is
    second to last (`b_KN`, or `w_EKN` with a leading expert dim).
    """

    name: ClassVar[str]
    activation_kind: ClassVar[str]
    weight_kind: ClassVar[str]

    def __init__(self, fmt: Fp8Format = E4M3):
        self.fmt = fmt

    def operand(self, operand: str) -> Operand:
        kinds = {"activation": self.activation_kind, "weight": self.weight_kind}
        if operand not in kinds:
            raise ValueError(f"operand={operand!r}; allowed: 'activation', 'weight'")
        return Operand(kinds[operand], self.fmt)

    def quantize(self, x: torch.Tensor, operand: str = "activation") -> tuple[torch.Tensor, torch.Tensor]:
        op = self.operand(operand)
        return quantize_tiles(x, tile_shape(op.tile, x), op.fmt, what=f"{self.name} {operand}")

    def dequantize(self, x_fp8: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_tiles(x_fp8, scale, dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fmt.name})"


class TensorwiseRecipe(Recipe):
    """One scale per tensor (per expert for a stacked weight)."""

    name, activation_kind, weight_kind = "tensorwise", "tensor", "tensor"


class RowwiseRecipe(Recipe):
    """One scale per activation row and per weight output column (torch `_scaled_mm` rowwise)."""

    name, activation_kind, weight_kind = "rowwise", "row", "col"


class BlockwiseRecipe(Recipe):
    """DeepSeek-V3: 1×128 activation tiles along K, 128×128 weight blocks; K, N multiples of 128."""

    name, activation_kind, weight_kind = "blockwise", "1x128", "128x128"


RECIPES: dict[str, type[Recipe]] = {r.name: r for r in (TensorwiseRecipe, RowwiseRecipe, BlockwiseRecipe)}


def make_recipe(name: str, fmt: str = "e4m3") -> Recipe:
    """Build a recipe by name (`precision.fp8`) and format name."""
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe {name!r} unknown; allowed: {sorted(RECIPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r} unknown; allowed: {sorted(FORMATS)}")
    return RECIPES[name](FORMATS[fmt])


def _fake_quant(x: torch.Tensor, recipe: Recipe, operand: str, dtype: torch.dtype) -> torch.Tensor:
    return recipe.dequantize(*recipe.quantize(x, operand), dtype=dtype)


def emulated_mm(a_MK: torch.Tensor, b_KN: torch.Tensor, recipe: Recipe,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What an FP8 GEMM computes: quantize both operands, dequantize, matmul in dtype.

    torch's CPU and CUDA bf16 matmuls accumulate in fp32 and round the output to bf16 once.
    """
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"emulated_mm needs a [M, K] @ [K, N]; got {tuple(a_MK.shape)} @ {tuple(b_KN.shape)}")
    return _fake_quant(a_MK, recipe, "activation", dtype) @ _fake_quant(b_KN, recipe, "weight", dtype)


def emulated_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor,
                        recipe: Recipe, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Expert GEMM: rows `offsets_E[e-1]:offsets_E[e]` of x times `w_EKN[e]`, with FP8 fake-quant.

    `offsets_E` are cumulative row ends, as `torch._grouped_mm` takes them; rows past the last
    offset are zero. Only recipes whose activation scales are per row (rowwise, blockwise) have a
    grouped form, so quantizing all rows at once equals quantizing each expert's rows; weights get
    their own scales per expert. No host sync.
    """
    if recipe.name == "tensorwise":
        raise ValueError("emulated_grouped_mm: recipe 'tensorwise' has no grouped form (one scale "
                         "would span all experts' rows); allowed: 'rowwise', 'blockwise'")
    if x_RK.dim() != 2 or w_EKN.dim() != 3 or x_RK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"emulated_grouped_mm needs x [R, K] and w [E, K, N]; "
                         f"got {tuple(x_RK.shape)} and {tuple(w_EKN.shape)}")
    if offsets_E.shape != (w_EKN.shape[0],):
        raise ValueError(f"offsets_E must have shape [E]=[{w_EKN.shape[0]}], got {tuple(offsets_E.shape)}")
    xq_RK = _fake_quant(x_RK, recipe, "activation", dtype)
    wq_EKN = _fake_quant(w_EKN, recipe, "weight", dtype)
    out_RN = torch._grouped_mm(xq_RK, wq_EKN, offs=offsets_E.to(torch.int32))
    used_R = torch.arange(x_RK.shape[0], device=x_RK.device) < offsets_E[-1]
    return torch.where(used_R[:, None], out_RN, torch.zeros((), dtype=out_RN.dtype))
