"""Rotary position embedding (RoPE) in the rotate-half convention of Llama, Qwen and Mixtral.

B batch, S sequence, H heads, Dh head dim.
"""

import torch


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[S, Dh]` (fp32), each half repeated so they pair with `rotate_half`."""
    inv_freq_half = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions_S = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles_S_half = torch.outer(positions_S, inv_freq_half)
    angles_SDh = torch.cat([angles_S_half, angles_S_half], dim=-1)
    return angles_SDh.cos(), angles_SDh.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys `[B, H, S, Dh]` by position; computed in fp32."""
    x = x_BHSDh.float()
    return (x * cos_SDh + _rotate_half(x) * sin_SDh).to(x_BHSDh.dtype)
