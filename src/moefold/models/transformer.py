"""Decoder-only transformer with dense and MoE layers on a configurable pattern, GQA or MLA
attention, and optional multi-token prediction.

B batch, S sequence, D model dim, V vocabulary, Dr RoPE dims per head.
Build with `build_model(cfg, vocab_size)`; every variant (attention, experts backend, QK-norm, tied
head, MTP) is chosen there, once.
"""

import math

import torch
from torch import nn

from moefold.config import Config, ModelConfig, moe_layers_in
from moefold.memory import apply_offload, apply_recompute
from moefold.models.attention import Attention, SlidingWindowMask
from moefold.models.init import init_weights_
from moefold.models.kv_cache import AnyLayerCache, KVCache
from moefold.models.mla import MLAttention
from moefold.models.mlp import SwiGLUMLP
from moefold.models.mtp import MTPModule, MultiTokenPrediction
from moefold.models.norm import RMSNorm
from moefold.models.rope import RopeScaling, rope_cos_sin, yarn_softmax_scale_factor
from moefold.moe.experts import Experts
from moefold.moe.layer import MoELayer, build_moe_layer, valid_mask
from moefold.moe.replay import RouterReplay


class Block(nn.Module):
    def __init__(self, attn: nn.Module, ffn: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim, norm_eps), attn
        self.ffn_norm, self.ffn = RMSNorm(dim, norm_eps), ffn

    def forward(self, x_BSD, cos_SDr, sin_SDr, valid_BS=None):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SDr, sin_SDr)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD), valid_BS)

    def decode(self, x_BSD, cos_SDr, sin_SDr, cache: AnyLayerCache):
        """`forward` of tokens that follow the ones `cache` holds (generation)."""
        x_BSD = x_BSD + self.attn.decode(self.attn_norm(x_BSD), cos_SDr, sin_SDr, cache)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD), None)


class Transformer(nn.Module):
    def __init__(self, cfg: Config, vocab_size: int, layers: list[Block],
                 mtp: MultiTokenPrediction | None = None):
        super().__init__()
        m = cfg.model
        self.cfg, self.vocab_size = cfg, vocab_size
        self.rope_dim = m.qk_rope_head_dim if m.attention == "mla" else (m.head_dim or m.dim // m.n_heads)
        self.rope_scaling = rope_scaling(m)
        self.tok_embeddings = nn.Embedding(vocab_size, m.dim)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(m.dim, m.norm_eps)
        self.output = nn.Linear(m.dim, vocab_size, bias=False)
        if m.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = mtp

    def rope(self, seq_len: int, device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables of positions start..start+seq_len−1."""
        return rope_cos_sin(seq_len, self.rope_dim, self.cfg.model.rope_theta, device=device,
                            scaling=self.rope_scaling, start=start)

    def trunk(self, input_ids_BS: torch.Tensor, valid_BS: torch.Tensor | None = None):
        """Hidden states after the last block (before the final norm), and the RoPE tables."""
        valid_BS = valid_mask(valid_BS, input_ids_BS.shape)  # checked here for dense models too
        cos_SDr, sin_SDr = self.rope(input_ids_BS.shape[1], input_ids_BS.device)
        x_BSD = self.tok_embeddings(input_ids_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD, cos_SDr, sin_SDr, valid_BS)
        return x_BSD, (cos_SDr, sin_SDr)

    def forward(self, input_ids_BS: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[B, S, V]`. `valid_BS` marks real tokens (False: padding, which MoE layers
        neither route nor count): bool, or integer 0/1 (`moe.layer.valid_mask`)."""
        h_BSD, _ = self.trunk(input_ids_BS, valid_BS)
        return self.output(self.norm(h_BSD))

    @torch.no_grad()
    def decode(self, input_ids_BS: torch.Tensor, cache: KVCache, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits `[B, S, V]` of tokens that follow the ones `cache` holds, which takes their keys
        and values: the last position's logits equal `forward`'s over the whole sequence.
        `logits_to_keep` (as transformers'): the last positions whose logits are computed, 0 for all;
        sampling keeps 1, as a prompt's [S, V] logits would cost S times the head's work and memory."""
        start, S = cache.length, input_ids_BS.shape[1]
        # the new positions' rows only: the whole table would cost each token O(start) work
        cos_SDr, sin_SDr = self.rope(S, input_ids_BS.device, start=start)
        x_BSD = self.tok_embeddings(input_ids_BS)
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x_BSD = layer.decode(x_BSD, cos_SDr, sin_SDr, layer_cache)
        kept_BSD = x_BSD[:, -logits_to_keep:] if logits_to_keep > 0 else x_BSD
        return self.output(self.norm(kept_BSD))

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache of `capacity` positions for `decode`: a sliding-window layer's keeps
        its window's keys only, any other layer's all of them (models/kv_cache.py)."""
        return KVCache(len(self.layers), capacity, [_sliding_window(layer.attn) for layer in self.layers])

    def blocks(self) -> list[Block]:
        """The main blocks, then the MTP modules' blocks (numbered on from n_layers)."""
        return list(self.layers) + ([m.block for m in self.mtp.layers] if self.mtp is not None else [])

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks() if isinstance(b.ffn, MoELayer)]

    def moe_layer_ids(self) -> list[int]:
        return [i for i, b in enumerate(self.blocks()) if isinstance(b.ffn, MoELayer)]

    def on_optimizer_step(self) -> None:
        for layer in self.moe_layers():
            layer.on_optimizer_step()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) for every matrix, depth-scaled for the residual output projections
        (GPT-2); ones for norms. Each matrix is drawn in blocks, each from a host generator seeded
        by (seed, the matrix's name, the block) (`models/init.py`), so every device and every
        parallel layout gets the same weights, and a parameter already sharded (a DTensor,
        `parallelize` on the meta device) draws only the blocks of its piece. Buffers (the MoE
        layers' counters, the expert bias) start at zero."""
        std = self.cfg.model.init_std
        init_weights_(self, std, std / math.sqrt(2 * len(self.layers)), seed)


MLA_LATENT_NORM_EPS = 1e-6


def _sliding_window(attn: nn.Module) -> int:
    """The window a layer's attention sees; 0 where it sees every key (causal GQA, MLA)."""
    mask = getattr(attn, "mask", None)
    return mask.window if isinstance(mask, SlidingWindowMask) else 0


def rope_scaling(m: ModelConfig) -> RopeScaling | None:
    if m.rope_scaling == "none":
        return None
    return RopeScaling(factor=m.rope_factor, original_max_len=m.rope_original_max_len,
                       beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow, mscale=m.yarn_mscale,
                       mscale_all_dim=m.yarn_mscale_all_dim, truncate=m.yarn_truncate)


def is_moe_layer(cfg: Config, layer_id: int) -> bool:
    """Layers count on through the MTP modules (layer n_layers + k - 1 is MTP module k's block)."""
    moe = cfg.moe
    return (moe.num_experts > 0 and layer_id >= moe.first_k_dense and layer_id not in moe.dense_layers
            and (layer_id - moe.first_k_dense) % moe.moe_every == 0)


def _build_attention(m: ModelConfig) -> nn.Module:
    if m.attention == "mla":
        # The latent norms use eps 1e-6 whatever rms_norm_eps is, as DeepSeek's reference and
        # transformers build them.
        return MLAttention(m.dim, m.n_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
                           m.qk_rope_head_dim, m.v_head_dim, MLA_LATENT_NORM_EPS,
                           softmax_scale_factor=yarn_softmax_scale_factor(rope_scaling(m)),
                           interleaved_rope=m.rope_interleaved)
    head_dim = m.head_dim or m.dim // m.n_heads
    return Attention(m.dim, m.n_heads, m.n_kv_heads or m.n_heads, head_dim, m.qk_norm, m.norm_eps,
                     m.sliding_window)


def _build_block(cfg: Config, layer_id: int, device_type: str, compute_dtype: torch.dtype,
                 replay: RouterReplay | None) -> Block:
    m = cfg.model
    if is_moe_layer(cfg, layer_id):
        ffn = build_moe_layer(m.dim, cfg.moe, device_type, compute_dtype, replay, cfg.parallel.etp, init_std=None)
    else:
        ffn = SwiGLUMLP(m.dim, m.ffn_hidden)
    return Block(_build_attention(m), ffn, m.dim, m.norm_eps)


def build_model(cfg: Config, vocab_size: int, device_type: str = "cpu",
                compute_dtype: torch.dtype = torch.float32) -> Transformer:
    """The model with uninitialised weights (call `init_weights`, or load a checkpoint).

    `device_type` and `compute_dtype` pick the experts backend that runs there. Works under
    `torch.device("meta")` for shapes and parameter counts of real-size models.
    """
    m = cfg.model
    num_layers = m.n_layers + m.mtp_layers
    num_moe_layers = sum(is_moe_layer(cfg, i) for i in range(num_layers))
    replay = RouterReplay(num_moe_layers) if num_moe_layers else None  # a dense model routes nothing
    blocks = [_build_block(cfg, i, device_type, compute_dtype, replay) for i in range(num_layers)]
    mtp = None
    if m.mtp_layers:
        mtp = MultiTokenPrediction([MTPModule(block, m.dim, m.norm_eps) for block in blocks[m.n_layers:]])
    model = Transformer(cfg, vocab_size, blocks[:m.n_layers], mtp)
    model.router_replay = replay  # record / replay routing for RL (moe/replay.py)
    # Recompute and offload wrap the chosen sites of this model instance (memory/).
    apply_recompute(model, cfg.memory.recompute, compiled=cfg.train.compile)
    model.activation_offload = apply_offload(model, cfg.memory.offload, cfg.memory.offload_min_bytes,
                                             device_type)
    return model


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Uninitialised storage on `device` for a model built under `torch.device("meta")`: its
    parameters in `dtype` (None keeps theirs), those shared (a tied head) still shared, and every
    buffer at zero, as `build_model` makes them (the MoE layers' counters and statistics, the
    router's expert bias). Then `init_weights`, or load a checkpoint: no copy of the model is ever
    made on the host, and no constructor's initialisation is computed only to be overwritten."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
                if dtype is not None and p.is_floating_point():
                    p.data = p.data.to(dtype)
    model.to_empty(device=device)
    # to_empty gives each module its own tensor when leaving the meta device: re-tie shared ones.
    for (first, first_name), *others in owners.values():
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.zero_()


__all__ = ["Transformer", "Block", "build_model", "materialize", "is_moe_layer", "moe_layers_in", "Experts"]
