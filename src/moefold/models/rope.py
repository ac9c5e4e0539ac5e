"""Rotary position embedding (RoPE) in the rotate-half convention of Llama, Qwen and Mixtral, with
YaRN context extension and DeepSeek's interleaved layout.

B batch, S sequence, H heads, Dh head dim (the rotated dims: DeepSeek MLA's qk_rope_head_dim).
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """YaRN (arXiv 2309.00071) as DeepSeek-V3 and transformers' `rope_type="yarn"` define it."""
    factor: float
    """Context extension factor s (DeepSeek-V3: 40)."""
    original_max_len: int
    """Context length of pre-training (transformers: original_max_position_embeddings)."""
    beta_fast: float = 32.0
    """Dims turning more than this many times over original_max_len keep their frequency."""
    beta_slow: float = 1.0
    """Dims turning fewer than this many times are interpolated by 1/factor; a ramp in between."""
    mscale: float = 1.0
    """Magnitude scale of the cos/sin tables (numerator of the attention factor)."""
    mscale_all_dim: float = 0.0
    """DeepSeek: divides the tables' scale and multiplies the softmax scale instead; 0 disables."""
    truncate: bool = True
    """Round the ramp's ends to whole dims (floor, ceil); false keeps them fractional (gpt-oss)."""


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """Multiplier of the cos/sin tables. As transformers' `_compute_yarn_parameters`: the ratio
    mscale/mscale_all_dim only when both are non-zero, else the paper's 0.1·ln(s) + 1."""
    if scaling.mscale and scaling.mscale_all_dim:
        return (_yarn_mscale(scaling.factor, scaling.mscale)
                / _yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return _yarn_mscale(scaling.factor)


def yarn_softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """Multiplier of the attention softmax scale Dh^-0.5: DeepSeek's mscale² with
    mscale = 0.1·mscale_all_dim·ln(s) + 1 (transformers' `yarn_apply_mscale`); 1 without YaRN."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    mscale = _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale * mscale


def _yarn_correction_dim(num_rotations: float, head_dim: int, theta: float, max_len: int) -> float:
    """The (fractional) frequency index whose wave turns `num_rotations` times over `max_len`."""
    return (head_dim * math.log(max_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))


def _pos_freqs_half(head_dim: int, theta: float, device) -> torch.Tensor:
    """theta^(2i/Dh), i < Dh/2: the reciprocal frequencies of plain RoPE."""
    return theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def _yarn_inv_freq_half(head_dim: int, theta: float, scaling: RopeScaling, device) -> torch.Tensor:
    """High frequencies extrapolated, low ones interpolated by 1/factor, a linear ramp between.
    The operation order copies transformers' so that the tables match it bit for bit."""
    pos_freqs_half = _pos_freqs_half(head_dim, theta, device)
    inv_freq_extrapolation = 1.0 / pos_freqs_half
    inv_freq_interpolation = 1.0 / (scaling.factor * pos_freqs_half)
    low = _yarn_correction_dim(scaling.beta_fast, head_dim, theta, scaling.original_max_len)
    high = _yarn_correction_dim(scaling.beta_slow, head_dim, theta, scaling.original_max_len)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    index_half = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    ramp_half = ((index_half - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp_half
    return (inv_freq_interpolation * (1 - extrapolation_weight)
            + inv_freq_extrapolation * extrapolation_weight)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None,
                 scaling: RopeScaling | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[S, Dh]` (fp32) of positions start..start+S−1, each half repeated so they
    pair with `rotate_half`. A decode step asks for its new positions only (`start`: the cached
    ones), whose rows equal the whole table's bit for bit.

    With YaRN `scaling` both tables are multiplied by `yarn_attention_factor`, as transformers
    does; the softmax part of DeepSeek's scaling is `yarn_softmax_scale_factor`, for the attention.
    """
    if scaling is None:
        inv_freq_half = 1.0 / _pos_freqs_half(head_dim, theta, device)
    else:
        inv_freq_half = _yarn_inv_freq_half(head_dim, theta, scaling, device)
    positions_S = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles_S_half = torch.outer(positions_S, inv_freq_half)
    angles_SDh = torch.cat([angles_S_half, angles_S_half], dim=-1)
    if scaling is None:
        return angles_SDh.cos(), angles_SDh.sin()
    attention_factor = yarn_attention_factor(scaling)
    return angles_SDh.cos() * attention_factor, angles_SDh.sin() * attention_factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys `[B, H, S, Dh]` by position; computed in fp32."""
    x = x_BHSDh.float()
    return (x * cos_SDh + _rotate_half(x) * sin_SDh).to(x_BHSDh.dtype)


def apply_rope_interleaved(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    """RoPE for DeepSeek's layout, where dims (0, 1), (2, 3), ... are the rotated pairs; computed in fp32.

    Equal to de-interleaving (evens, then odds) and `apply_rope`, so the result is in the
    rotate-half layout, as in transformers' `rope_interleave=True`. Queries and keys both go
    through it, so q·k is what DeepSeek's complex-number RoPE gives. Takes the same tables.
    """
    x = x_BHSDh.float()
    half = cos_SDh.shape[-1] // 2
    cos_S_half, sin_S_half = cos_SDh[..., :half], sin_SDh[..., :half]
    x_even, x_odd = x[..., 0::2], x[..., 1::2]  # strided views: no de-interleaving copy
    out = torch.cat([x_even * cos_S_half - x_odd * sin_S_half,
                     x_odd * cos_S_half + x_even * sin_S_half], dim=-1)
    return out.to(x_BHSDh.dtype)
