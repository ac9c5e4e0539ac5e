"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 (arXiv 2405.04434), through
scaled_dot_product_attention.

B batch, S sequence, D model dim, H heads, Q query latent (q_lora_rank), C key/value latent
(kv_lora_rank), Dn per-head dims without RoPE, Dr per-head dims with RoPE (shared by all heads for
keys), Dk = Dn + Dr query/key head dim, Dv value head dim.

Training form: the latent is expanded into per-head keys and values (no weight absorption, which
only pays off when decoding from a latent KV cache).
"""

import torch
import torch.nn.functional as F
from torch import nn

from moefold.models.attention import causal_mask
from moefold.models.kv_cache import LayerCache
from moefold.models.norm import RMSNorm
from moefold.models.rope import apply_rope, apply_rope_interleaved


class MLAttention(nn.Module):
    """Parameter names are fixed: the Hugging Face checkpoint mapping depends on them."""

    def __init__(self, dim: int, n_heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, norm_eps: float, softmax_scale_factor: float = 1.0,
                 interleaved_rope: bool = True):
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = qk_nope_head_dim + qk_rope_head_dim, v_head_dim
        # DeepSeek's YaRN multiplies the softmax scale by mscale² (rope.yarn_softmax_scale_factor).
        self.softmax_scale = self.qk_head_dim ** -0.5 * softmax_scale_factor
        # DeepSeek-V3 checkpoints store the rope dims of wq/wkv_a pairwise interleaved.
        self.rope = apply_rope_interleaved if interleaved_rope else apply_rope
        if q_lora_rank > 0:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        # One projection gives the latent and the single rope key shared by every head (MQA-like).
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def attention_flops_dims(self) -> tuple[int, int, int]:
        """(n_heads, qk_head_dim, v_head_dim) for `train.flops.attention_flops_per_token`."""
        return self.n_heads, self.qk_head_dim, self.v_head_dim

    def forward(self, x_BSD: torch.Tensor, cos_SDr: torch.Tensor, sin_SDr: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_in_BSX, latent_BSC, k_rope_BSDr = self.down_proj(x_BSD)
        q_BHSDk, k_BHSDk, v_BHSDv = self.up_proj(q_in_BSX, latent_BSC, k_rope_BSDr, cos_SDr, sin_SDr)
        return self.out(self.core(q_BHSDk, k_BHSDk, v_BHSDv))

    def decode(self, x_BSD: torch.Tensor, cos_SDr: torch.Tensor, sin_SDr: torch.Tensor,
               cache: LayerCache) -> torch.Tensor:
        """`forward` of tokens that follow the cached ones: their per-head keys and values join the
        cache (expanded; decoding from the latent with absorbed weights would cache less)."""
        start = cache.length
        q_BHSDk, k_BHSDk, v_BHSDv = self.up_proj(*self.down_proj(x_BSD), cos_SDr, sin_SDr)
        k_BHPDk, v_BHPDv = cache.extend(k_BHSDk, v_BHSDv)
        # SDPA itself, not `core`: the recompute/offload wrappers there are training's.
        out_BHSDv = F.scaled_dot_product_attention(q_BHSDk, k_BHPDk, v_BHPDv, scale=self.softmax_scale,
                                                   **causal_mask(start, x_BSD.shape[1], x_BSD.device))
        return self.out(out_BHSDv)

    def out(self, out_BHSDv: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = out_BHSDv.shape
        return self.wo(out_BHSDv.transpose(1, 2).reshape(B, S, self.n_heads * self.v_head_dim))

    def down_proj(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query input (its latent with q-LoRA, else x itself), the key/value latent and the rope
        key shared by every head."""
        q_in_BSX = self.wq_a(x_BSD) if self.q_lora_rank > 0 else x_BSD
        latent_BSC, k_rope_BSDr = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q_in_BSX, latent_BSC, k_rope_BSDr

    def up_proj(self, q_in_BSX: torch.Tensor, latent_BSC: torch.Tensor, k_rope_BSDr: torch.Tensor,
                cos_SDr: torch.Tensor, sin_SDr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head queries, keys and values with RoPE applied, from the latents: the large tensors
        the core keeps, which memory.recompute = ["mla_up_proj"] rebuilds instead."""
        B, S, _ = latent_BSC.shape
        H, Dn, Dr, Dv = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_BSX = self.wq_b(self.q_norm(q_in_BSX)) if self.q_lora_rank > 0 else self.wq(q_in_BSX)
        q_nope_BHSDn, q_rope_BHSDr = q_BSX.view(B, S, H, Dn + Dr).transpose(1, 2).split([Dn, Dr], dim=-1)
        kv_BHSE = self.wkv_b(self.kv_norm(latent_BSC)).view(B, S, H, Dn + Dv).transpose(1, 2)
        k_nope_BHSDn, v_BHSDv = kv_BHSE.split([Dn, Dv], dim=-1)
        q_rope_BHSDr = self.rope(q_rope_BHSDr, cos_SDr, sin_SDr)
        k_rope_B1SDr = self.rope(k_rope_BSDr.unsqueeze(1), cos_SDr, sin_SDr)
        q_BHSDk = torch.cat([q_nope_BHSDn, q_rope_BHSDr], dim=-1)
        k_BHSDk = torch.cat([k_nope_BHSDn, k_rope_B1SDr.expand(B, H, S, Dr)], dim=-1)
        return q_BHSDk, k_BHSDk, v_BHSDv

    def core(self, q_BHSDk: torch.Tensor, k_BHSDk: torch.Tensor, v_BHSDv: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ)·v: a seam that memory.recompute / memory.offload ("attn_core") wrap."""
        # Dv != Dk rules out SDPA's flash kernel, but on H200 (torch 2.11) it picks cuDNN, which ran
        # fwd+bwd 1.5x faster than padding v to Dk for flash (Dk 192, Dv 128, S 4096, bf16). Where
        # cuDNN attention is unavailable SDPA falls back to the memory-efficient kernel, ~4x slower
        # than padded flash.
        return F.scaled_dot_product_attention(q_BHSDk, k_BHSDk, v_BHSDv, is_causal=True,
                                              scale=self.softmax_scale)
