"""Grouped-query attention with optional per-head QK RMSNorm, through scaled_dot_product_attention.

B batch, S sequence, D model dim, H query heads, G key/value heads, Dh head dim.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moefold.models.kv_cache import AnyLayerCache
from moefold.models.norm import RMSNorm
from moefold.models.rope import apply_rope


class CausalMask:
    """SDPA's mask arguments for queries at positions start..start+S−1 over keys
    first_key..start+S−1 (a whole sequence when start is 0; new tokens over cached ones in
    generation), causal. Every earlier key is seen: a decode step reads the cache from key 0."""

    def first_key(self, start: int) -> int:
        return 0

    def __call__(self, start: int, num_new: int, device, first_key: int = 0) -> dict:
        if num_new == 1:
            return {}  # one new token sees every key
        if start == 0:
            return {"is_causal": True}  # square: SDPA's fused kernels mask themselves
        return {"attn_mask": _distance_SP(start, num_new, device, first_key) >= 0}


causal_mask = CausalMask()


class SlidingWindowMask(CausalMask):
    """`causal_mask` within the latest `window` positions, the token itself included (Mixtral).
    Keys that all lie within the window (a sequence no longer than it) are `causal_mask`'s, so
    SDPA's fused kernels mask themselves rather than read an [S, P] mask (3x faster at S = 4096
    on an H200). A decode step reads the keys from `first_key` on: a token after P cached ones
    attends over W keys, unmasked, not over P + 1 through a [1, P + 1] mask."""

    def __init__(self, window: int):
        self.window = window

    def first_key(self, start: int) -> int:
        """The earliest key that query `start`, and so any later one, sees."""
        return max(0, start + 1 - self.window)

    def __call__(self, start: int, num_new: int, device, first_key: int = 0) -> dict:
        if start + num_new - first_key <= self.window:  # the last query sees every key given
            return causal_mask(start, num_new, device, first_key)
        distance_SP = _distance_SP(start, num_new, device, first_key)
        return {"attn_mask": (distance_SP >= 0) & (distance_SP < self.window)}


def _distance_SP(start: int, num_new: int, device, first_key: int = 0) -> torch.Tensor:
    """Query position minus key position, for queries start.. over keys first_key..start+S−1."""
    return (torch.arange(start, start + num_new, device=device)[:, None]
            - torch.arange(first_key, start + num_new, device=device)[None, :])


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool,
                 norm_eps: float, sliding_window: int = 0):
        super().__init__()
        self.mask = SlidingWindowMask(sliding_window) if sliding_window else causal_mask
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Qwen3/OLMoE normalise each head before RoPE; nn.Identity keeps the forward branch-free.
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else nn.Identity()

    def forward(self, x_BSD: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
        q_BHSDh, k_BGSDh, v_BGSDh = self.qkv(x_BSD, cos_SDh, sin_SDh)
        out_BHSDh = self.core(q_BHSDh, k_BGSDh, v_BGSDh, **self.mask(0, x_BSD.shape[1], x_BSD.device))
        return self.out(out_BHSDh)

    def decode(self, x_BSD: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor,
               cache: AnyLayerCache) -> torch.Tensor:
        """`forward` of tokens that follow the cached ones (the RoPE tables at their positions):
        their keys and values join the cache, their queries attend over the keys they can see."""
        start, S = cache.length, x_BSD.shape[1]
        q_BHSDh, k_BGSDh, v_BGSDh = self.qkv(x_BSD, cos_SDh, sin_SDh)
        held_from = cache.first_position  # the position of the first key `extend` returns
        k_BGPDh, v_BGPDh = cache.extend(k_BGSDh, v_BGSDh)
        first = self.mask.first_key(start)  # keys before it lie outside every new query's window
        skip = first - held_from  # a windowed cache returns none before it (skip 0), a full one all
        # SDPA itself, not `core`: the recompute/offload wrappers there are training's.
        out_BHSDh = F.scaled_dot_product_attention(
            q_BHSDh, k_BGPDh[:, :, skip:], v_BGPDh[:, :, skip:], enable_gqa=self.n_kv_heads != self.n_heads,
            **self.mask(start, S, x_BSD.device, first))
        return self.out(out_BHSDh)

    def qkv(self, x_BSD: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor):
        """Queries, keys and values per head, QK-normed and rotated."""
        B, S, _ = x_BSD.shape
        q_BHSDh = self.q_norm(self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)).transpose(1, 2)
        k_BGSDh = self.k_norm(self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v_BGSDh = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q_BHSDh, cos_SDh, sin_SDh), apply_rope(k_BGSDh, cos_SDh, sin_SDh), v_BGSDh

    def out(self, out_BHSDh: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out_BHSDh.shape
        return self.wo(out_BHSDh.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def core(self, q_BHSDh: torch.Tensor, k_BGSDh: torch.Tensor, v_BGSDh: torch.Tensor,
             **mask) -> torch.Tensor:
        """softmax(q·kᵀ)·v: a seam that memory.recompute / memory.offload ("attn_core") wrap."""
        return F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh,
                                              enable_gqa=self.n_kv_heads != self.n_heads, **mask)
