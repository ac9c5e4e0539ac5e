"""RMSNorm, computed in fp32 whatever the input dtype and rounded once, after the weight (as
Megatron-Core and Transformer Engine do). transformers' Llama/Qwen/DeepSeek norms round the
normalized value to the input dtype before multiplying by the weight: in bf16 the two differ by at
most one ulp of the output."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale().float()).to(x.dtype)

    def scale(self) -> torch.Tensor:
        """The weight as forward uses it (tensor parallelism hooks its gradient here)."""
        return self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
