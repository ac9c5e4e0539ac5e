"""What an FP8 GEMM keeps of its input for the backward pass (`precision.fp8_saved_activations`),
chosen once when `apply_fp8` converts a module.

`SaveInput` keeps the input as the forward received it (the compute dtype). `SaveFp8Input` keeps it
in FP8 with the forward GEMM's own activation tiles (rows for rowwise, 1x128 for blockwise, one
scale for tensorwise) — 1 byte per element plus the scales instead of 2 — and dequantizes it for
the backward. grad_weight then quantizes those values again with its own tiles (columns, 128x1): a
second rounding, the price of the memory (DeepSeek-V3 also caches activations in FP8 with 1x128
tiles). grad_input never reads the input.

Without grad (evaluation, generation) autograd keeps nothing for a backward, so the GEMMs take
`kept_for_backward(saver)`: the plain `SaveInput`, whose pack is free, instead of quantizing the
input for nothing.
"""

from __future__ import annotations

import torch

from moefold.fp8.recipes import Operand, dequantize_tiles, quantize


class SaveInput:
    name = "input"

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    def unpack(self, packed: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return packed[0]


class SaveFp8Input(SaveInput):
    name = "fp8"

    def __init__(self, op: Operand):
        self.op = op  # the forward GEMM's activation operand

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize(x, self.op)  # (x_fp8, scale)

    def unpack(self, packed: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_tiles(*packed, dtype=dtype)


_AS_IS = SaveInput()


def kept_for_backward(saver: SaveInput) -> SaveInput:
    """`saver` when this forward builds a graph; without grad nothing is kept, so nothing to pack.
    (Asked at the autograd function's call: inside its forward grad is always off.)"""
    return saver if torch.is_grad_enabled() else _AS_IS


def saved_input(fp8_saved_activations: bool, forward_activation: Operand) -> SaveInput:
    return SaveFp8Input(forward_activation) if fp8_saved_activations else SaveInput()
