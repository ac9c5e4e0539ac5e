"""The dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
