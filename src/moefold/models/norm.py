"""RMSNorm, computed in fp32 whatever the input dtype (as Llama, Qwen and DeepSeek do)."""

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
