"""`precision.fp8_weight_cache`: the routed experts' weights quantized to FP8 once per optimizer
step instead of in every micro-batch (docs/fp8.md).

Without it every expert GEMM quantizes its weight when it runs: the forward w, the backward w^T,
in each micro-batch, though the weights change only at the optimizer step. With it, `refresh`
(the trainer calls it once the weights are built or loaded, and after each optimizer step) writes
both operands of every expert weight into buffers of its experts module, and the GEMMs read them:
with train.grad_accum = n the weights' quantization runs once a step instead of n times. The
price is memory held for the whole run: both FP8 layouts of every expert weight, 2 bytes per
parameter plus scales (4 in the emulation, which keeps dequantized bf16 values), where per-call
quantization holds one weight's FP8 copy at a time. Transformer Engine caches FP8 weights across
micro-batches the same way (its `is_first_microbatch`).

The strategy is the experts module's `weight_cache`, chosen by apply_fp8; the GEMMs take what
`operands` returns (None: quantize here).
"""

from __future__ import annotations

import torch
from torch import nn

from moefold.parallel.local import local_tensor

_PHASES = ("forward", "grad_input")


class PerCallWeights:
    """Each GEMM quantizes its weight when it runs (the default)."""

    def operands(self, experts: nn.Module, names: list[str]) -> None:
        return None

    def refresh(self, experts: nn.Module) -> None:
        pass


class CachedWeights:
    """Both FP8 operands of each expert weight (the forward's w, grad_input's w^T), quantized by
    `refresh` from the weights cast as the experts' forward casts them (moe/experts.py
    compute_dtype: to `autocast_dtype` under autocast, else to their input's dtype, which is then
    the parameters' own: bf16 masters in fp32 compute run the experts in bf16) and kept as
    non-persistent buffers of the experts module: checkpoints never hold them, `.to()` moves them,
    and a compiled block reads them as inputs."""

    def __init__(self, autocast_dtype: torch.dtype | None):
        self.autocast_dtype = autocast_dtype

    def operands(self, experts: nn.Module, names: list[str]):
        """(forward operands, grad_input operands) of the weights `names`, as fp8_grouped_mms'
        `cached` takes them."""
        if not hasattr(experts, _buffer_name(names[0], "forward", 0)):
            raise RuntimeError("precision.fp8_weight_cache: the experts' FP8 weights were never quantized; "
                               "call moefold.fp8.weight_cache.refresh_weight_caches(model) after building "
                               "or loading the weights and after every optimizer step")
        return tuple([_operands(experts, name, phase) for name in names] for phase in _PHASES)

    @torch.no_grad()
    def refresh(self, experts: nn.Module) -> None:
        gemm, scaling = experts.gemm, experts.scaling
        for name in experts.weight_names():
            w_EKN = local_tensor(getattr(experts, name))
            w_EKN = w_EKN.to(self.autocast_dtype or w_EKN.dtype)
            fresh = {"forward": gemm.weight_operands(w_EKN, scaling.forward.b),
                     "grad_input": gemm.weight_operands(w_EKN.transpose(-2, -1), scaling.grad_input.b)}
            for phase, operands in fresh.items():
                for i, operand in enumerate(operands):
                    # Replaced, not copied into: a compiled graph takes buffers as inputs (checked
                    # by shape, stride and dtype, which stay), and a copy would cost a pass.
                    experts.register_buffer(_buffer_name(name, phase, i), operand, persistent=False)
        experts.fp8_operands_per_weight = len(fresh["forward"])  # the backend's, for every weight and phase


def _buffer_name(weight: str, phase: str, i: int) -> str:
    return f"fp8_{weight}_{phase}_{i}"


def _operands(experts: nn.Module, name: str, phase: str) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(experts, _buffer_name(name, phase, i)) for i in range(experts.fp8_operands_per_weight))


def refresh_weight_caches(model: nn.Module) -> None:
    """Quantize every cached expert weight again from its current values; a no-op for experts
    that quantize per call. Call it once the weights are built or loaded and after every change
    to them (the trainer does, after each optimizer step)."""
    for module in model.modules():
        cache = getattr(module, "weight_cache", None)
        if cache is not None:
            cache.refresh(module)


def build_weight_cache(enabled: bool, compute_dtype: torch.dtype | None):
    if not enabled:
        return PerCallWeights()
    if compute_dtype is None:
        raise ValueError("precision.fp8_weight_cache needs the compute dtype the experts cast their weights to")
    # The trainer autocasts only below fp32 (Trainer.autocast); in fp32 nothing casts the experts'
    # input, so they compute in their parameters' dtype (bf16 under bf16 masters), not in fp32.
    return CachedWeights(None if compute_dtype == torch.float32 else compute_dtype)
