"""Routed experts: E SwiGLU MLPs stored as stacked `[E, ...]` weights.

N routed rows (grouped by expert), D model dim, F expert hidden, E experts.
Backends differ only in `_mm`, the grouped matrix product; everything else is shared. The backend is
chosen once, when the model is built (`build_experts`).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (grouped_mm is not an autocast op), else x's dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class Experts(nn.Module):
    """Base class: SwiGLU over grouped rows, down(silu(x·W1) * (x·W3))."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))  # gate
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))  # up
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))  # down

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x_ND)
        x_ND = x_ND.to(dtype)
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate_NF = self._mm(x_ND, self.w1_EDF.to(dtype), offsets_E)
        up_NF = self._mm(x_ND, self.w3_EDF.to(dtype), offsets_E)
        return self._mm(F.silu(gate_NF) * up_NF, self.w2_EFD.to(dtype), offsets_E)

    def _mm(self, x_NX: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupedMMExperts(Experts):
    """One `torch._grouped_mm` per projection: no host sync, one launch for all experts."""

    def _mm(self, x_NX, w_EXY, offsets_E):
        return torch._grouped_mm(x_NX, w_EXY, offs=offsets_E)


class LoopExperts(Experts):
    """One matmul per expert. Needs the group sizes on the host (a sync); a fallback only."""

    def _mm(self, x_NX, w_EXY, offsets_E):
        ends = offsets_E.tolist()  # HOST SYNC: per-expert slices need sizes on the host
        starts = [0] + ends[:-1]
        outs = [x_NX[s:e] @ w_EXY[i] for i, (s, e) in enumerate(zip(starts, ends))]
        return torch.cat(outs, dim=0)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs `torch._grouped_mm` forward and backward on device/dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(32, 16, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([16, 32], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(32, 16, device=device_type, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


EXPERTS_BACKENDS = {"grouped_mm": GroupedMMExperts, "loop": LoopExperts}


def build_experts(backend: str, num_experts: int, dim: int, hidden: int,
                  device_type: str, compute_dtype: torch.dtype) -> Experts:
    if backend == "auto":
        backend = "grouped_mm" if grouped_mm_supported(device_type, compute_dtype) else "loop"
    return EXPERTS_BACKENDS[backend](num_experts, dim, hidden)
