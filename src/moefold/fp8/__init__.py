"""FP8 numerics: a plain-PyTorch emulation of each scaling recipe (see docs/fp8.md)."""

from moefold.fp8.recipes import (
    E4M3,
    E5M2,
    BlockwiseRecipe,
    Fp8Format,
    Recipe,
    RowwiseRecipe,
    TensorwiseRecipe,
    emulated_grouped_mm,
    emulated_mm,
    make_recipe,
)

__all__ = [
    "E4M3", "E5M2", "Fp8Format", "Recipe", "TensorwiseRecipe", "RowwiseRecipe", "BlockwiseRecipe",
    "make_recipe", "emulated_mm", "emulated_grouped_mm",
]
