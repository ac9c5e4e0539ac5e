"""Decoder-only transformer with dense and MoE layers on a configurable pattern.

B batch, S sequence, D model dim, V vocabulary, Dh head dim.
Build with `build_model(cfg, vocab_size)`; every variant (experts backend, QK-norm, tied head) is
chosen there, once.
"""

import math

import torch
from torch import nn

from moefold.config import Config
from moefold.models.attention import Attention
from moefold.models.mlp import SwiGLUMLP
from moefold.models.norm import RMSNorm
from moefold.models.rope import rope_cos_sin
from moefold.moe.experts import Experts
from moefold.moe.layer import MoELayer, build_moe_layer
from moefold.moe.replay import RouterReplay


class Block(nn.Module):
    def __init__(self, attn: Attention, ffn: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim, norm_eps), attn
        self.ffn_norm, self.ffn = RMSNorm(dim, norm_eps), ffn

    def forward(self, x_BSD, cos_SDh, sin_SDh, valid_BS=None):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SDh, sin_SDh)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD), valid_BS)


class Transformer(nn.Module):
    def __init__(self, cfg: Config, vocab_size: int, layers: list[Block]):
        super().__init__()
        m = cfg.model
        self.cfg, self.vocab_size = cfg, vocab_size
        self.head_dim = m.head_dim or m.dim // m.n_heads
        self.tok_embeddings = nn.Embedding(vocab_size, m.dim)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(m.dim, m.norm_eps)
        self.output = nn.Linear(m.dim, vocab_size, bias=False)
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids_BS: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[B, S, V]`. `valid_BS` marks real tokens (False: padding, which MoE layers
        neither route nor count)."""
        cos_SDh, sin_SDh = rope_cos_sin(input_ids_BS.shape[1], self.head_dim, self.cfg.model.rope_theta,
                                        device=input_ids_BS.device)
        x_BSD = self.tok_embeddings(input_ids_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD, cos_SDh, sin_SDh, valid_BS)
        return self.output(self.norm(x_BSD))

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def on_optimizer_step(self) -> None:
        for layer in self.moe_layers():
            layer.on_optimizer_step()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) for every matrix, depth-scaled for the residual output projections
        (GPT-2); ones for norms."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.cfg.model.init_std
        residual_std = std / math.sqrt(2 * len(self.layers))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            is_residual_out = name.endswith(("attn.wo.weight", "w2.weight", "w2_EFD"))
            sample = torch.randn(p.shape, generator=gen) * (residual_std if is_residual_out else std)
            p.copy_(sample)


def is_moe_layer(cfg: Config, layer_id: int) -> bool:
    moe = cfg.moe
    return (moe.num_experts > 0 and layer_id >= moe.first_k_dense
            and (layer_id - moe.first_k_dense) % moe.moe_every == 0)


def _build_ffn(cfg: Config, layer_id: int, device_type: str, compute_dtype: torch.dtype,
               replay: RouterReplay) -> nn.Module:
    if not is_moe_layer(cfg, layer_id):
        return SwiGLUMLP(cfg.model.dim, cfg.model.ffn_hidden)
    return build_moe_layer(cfg.model.dim, cfg.moe, device_type, compute_dtype, replay)


def build_model(cfg: Config, vocab_size: int, device_type: str = "cpu",
                compute_dtype: torch.dtype = torch.float32) -> Transformer:
    """The model with uninitialised weights (call `init_weights`, or load a checkpoint).

    `device_type` and `compute_dtype` pick the experts backend that runs there.
    """
    m = cfg.model
    head_dim = m.head_dim or m.dim // m.n_heads
    replay = RouterReplay(sum(is_moe_layer(cfg, i) for i in range(m.n_layers)))
    layers = []
    for layer_id in range(m.n_layers):
        attn = Attention(m.dim, m.n_heads, m.n_kv_heads or m.n_heads, head_dim, m.qk_norm, m.norm_eps)
        ffn = _build_ffn(cfg, layer_id, device_type, compute_dtype, replay)
        layers.append(Block(attn, ffn, m.dim, m.norm_eps))
    model = Transformer(cfg, vocab_size, layers)
    model.router_replay = replay  # record / replay routing for RL (moe/replay.py)
    return model


__all__ = ["Transformer", "Block", "build_model", "is_moe_layer", "Experts"]
