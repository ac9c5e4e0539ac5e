"""`Fp8Linear`: an nn.Linear whose three GEMMs run in FP8 through a GEMM backend given at build time.

M tokens (all leading dims flattened), K input features, N output features.
The backend (gemm.py: emulated or cuBLAS) and the recipe's scaling are fixed when `apply_fp8`
converts the module; the forward never asks which one it has. Scales are computed on the fly from
the current tensors (no amax history). The input is saved for backward as `saver` says
(fp8/saved.py: in the compute dtype, or in FP8 with precision.fp8_saved_activations).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from moefold.fp8.gemm import Fp8GemmBase, Fp8Scaling
from moefold.fp8.saved import SaveInput, kept_for_backward
from moefold.moe.experts import compute_dtype


class _Fp8LinearFn(torch.autograd.Function):
    """y_MN = x_MK @ W_NK^T; grad_x = grad_y @ W; grad_W = grad_y^T @ x, each GEMM in FP8."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, gemm, scaling: Fp8Scaling, saver: SaveInput):
        ctx.save_for_backward(w_NK, *saver.pack(x_MK))
        ctx.gemm, ctx.scaling, ctx.saver = gemm, scaling, saver
        return gemm.mm(x_MK, w_NK.t(), scaling.forward, x_MK.dtype)

    @staticmethod
    def backward(ctx, grad_MN):
        w_NK, *packed = ctx.saved_tensors
        gemm, scaling = ctx.gemm, ctx.scaling
        x_MK = ctx.saver.unpack(packed, w_NK.dtype)  # x and w arrive in the one compute dtype
        grad_MN = grad_MN.to(x_MK.dtype)
        grad_x_MK = grad_w_NK = None
        if ctx.needs_input_grad[0]:
            grad_x_MK = gemm.mm(grad_MN, w_NK, scaling.grad_input, x_MK.dtype)
        if ctx.needs_input_grad[1]:
            grad_w_NK = gemm.weight_grad(grad_MN, x_MK, scaling, w_NK.dtype)
        return grad_x_MK, grad_w_NK, None, None, None


class PlainShards:
    """Input, weight and output are plain tensors (no tensor parallelism)."""

    def local(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, w

    def wrap(self, y: torch.Tensor) -> torch.Tensor:
        return y


class ColumnShards(PlainShards):
    """Under tensor parallelism (parallel/tensor.py) the input and weight arrive as DTensors and the
    FP8 GEMMs run on the local shards. A column-wise weight (Shard(0): this rank's output features)
    reads the whole, replicated input, whose gradient is then partial over the TP group, and gives
    this rank's Shard(-1) of the output. Scales are the shards' own (as each data rank scales its
    own tokens), so TP is close to one process, not equal."""

    def __init__(self, weight: DTensor):
        self.mesh = weight.device_mesh

    def local(self, x: DTensor, w: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to_local(grad_placements=[Partial()]), w.to_local()

    def wrap(self, y: torch.Tensor) -> DTensor:
        return DTensor.from_local(y, self.mesh, [Shard(y.ndim - 1)], run_check=False)


class RowShards(ColumnShards):
    """A row-wise weight (Shard(1): this rank's input features) reads the input's matching shard and
    gives partial sums, which the TP style's output hook reduces."""

    def local(self, x: DTensor, w: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to_local(grad_placements=[Shard(x.ndim - 1)]), w.to_local()

    def wrap(self, y: torch.Tensor) -> DTensor:
        return DTensor.from_local(y, self.mesh, [Partial()], run_check=False)


class TokenShards(ColumnShards):
    """A replicated weight (Replicate) reading this rank's shard of the sequence (Shard(1) of
    [B, S, K]; MLA's down-projections under sequence parallelism): the GEMMs run on the local
    tokens and give the same shard of the output. The weight's gradient is this rank's tokens'
    part of the TP group's sum (Partial), as DTensor leaves a sequence-parallel norm's."""

    def local(self, x: DTensor, w: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to_local(), w.to_local(grad_placements=[Partial()])

    def wrap(self, y: torch.Tensor) -> DTensor:
        return DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False)


def shard_fp8_linears(module: nn.Module) -> None:
    """Give every Fp8Linear in `module` whose weight tensor parallelism distributed the local-shard
    strategy of its layout (called by parallel/tensor.py after it parallelizes the model)."""
    for m in module.modules():
        if isinstance(m, Fp8Linear) and isinstance(m.weight, DTensor):
            m.shards = _SHARDS_BY_PLACEMENT[m.weight.placements[0]](m.weight)


_SHARDS_BY_PLACEMENT = {Shard(0): ColumnShards, Shard(1): RowShards, Replicate(): TokenShards}


class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs; same parameters and state dict as the nn.Linear it replaces."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 gemm: Fp8GemmBase, scaling: Fp8Scaling,
                 saver: SaveInput | None = None, device=None, discarded_input_saver: SaveInput | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.gemm, self.scaling, self.saver = gemm, scaling, saver or SaveInput()
        # What to keep once memory.recompute frees the input after the parent ran (apply_fp8:
        # the input as it is where the linear reads the freed tensor itself, else `saver`).
        self.discarded_input_saver = discarded_input_saver or self.saver
        self.shards: PlainShards = PlainShards()  # Column/RowShards once TP shards the weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, gemm, scaling: Fp8Scaling, saver: SaveInput | None = None,
                    discarded_input_saver: SaveInput | None = None) -> Fp8Linear:
        """Wrap `linear`'s own parameters (no copy; built on meta so nothing is allocated)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, gemm, scaling,
                  saver, device="meta", discarded_input_saver=discarded_input_saver)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def memory_input_discarded(self) -> None:
        """Told by memory/sites.py (`InputAware`) that memory.recompute frees the parent's input
        once the parent ran and rebuilds it for the backward (a recomputed pre-norm's output):
        a linear that reads that tensor itself keeps it as it is, since an FP8 copy
        (precision.fp8_saved_activations) would outlive the free. Whether the recompute was
        applied before apply_fp8 made this linear or after it."""
        self.saver = self.discarded_input_saver

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        x, w_NK = self.shards.local(x, self.weight)
        x_MK = x.reshape(-1, x.shape[-1]).to(dtype)
        y_MN = _Fp8LinearFn.apply(x_MK, w_NK.to(dtype), self.gemm, self.scaling, kept_for_backward(self.saver))
        y = self.shards.wrap(y_MN.view(*x.shape[:-1], w_NK.shape[0]))
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8={self.scaling.name}, gemm={self.gemm.name}, "
                f"saves={self.saver.name}")
