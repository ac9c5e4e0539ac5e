"""Shared experts: a dense MLP every token passes through beside the routed experts (DeepSeek,
Qwen2-MoE). `n` shared experts of hidden F are fused into one MLP of hidden n·F.

T tokens, D model dim, F hidden.
"""

import torch
from torch import nn

from moefold.moe.activation import Activation


class SharedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: Activation):
        super().__init__()
        self.act = activation
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate (or the only input)
        if activation.num_inputs == 2:
            self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        inputs_TF = [self.w1(x_TD), self.w3(x_TD)] if self.act.num_inputs == 2 else [self.w1(x_TD)]
        return self.w2(self.act.fn(*inputs_TF))


class GatedSharedExperts(SharedExperts):
    """Output scaled by a learned per-token sigmoid gate (Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, dim: int, hidden: int, activation: Activation):
        super().__init__(dim, hidden, activation)
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x_TD)) * super().forward(x_TD)
