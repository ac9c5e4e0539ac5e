"""Parameter counts by module, split by how the parallel layout shards them, from the config alone.

Three kinds, because each is divided differently on a rank:
- `tp`: weights tensor parallelism splits (attention q/k/v/o and MLA up-projections by heads,
  dense MLP and shared-expert hidden);
- `replicated`: dense weights every TP rank holds whole (norms, MLA down-projections, routers, a
  shared-expert gate, embedding and output head: moefold's TP leaves those replicated);
- `expert`: routed-expert weights, split over ep·etp.
Their sum over a model equals `count_params(meta_model(cfg)).total` exactly (tests hold it).
"""

from __future__ import annotations

from dataclasses import dataclass

from moefold.config import Config
from moefold.models.transformer import moe_layers_in


@dataclass(frozen=True)
class ParamSplit:
    tp: int = 0
    replicated: int = 0
    expert: int = 0
    # Elements of the largest single dense / expert tensor (the optimizer's per-tensor workspace).
    largest_dense: int = 0
    largest_expert: int = 0

    def __add__(self, other: ParamSplit) -> ParamSplit:
        return ParamSplit(self.tp + other.tp, self.replicated + other.replicated,
                          self.expert + other.expert, max(self.largest_dense, other.largest_dense),
                          max(self.largest_expert, other.largest_expert))

    def __mul__(self, copies: int) -> ParamSplit:
        """`copies` modules of this split (the largest tensors unchanged, none when there are none)."""
        if copies == 0:
            return ParamSplit()
        return ParamSplit(self.tp * copies, self.replicated * copies, self.expert * copies,
                          self.largest_dense, self.largest_expert)

    @property
    def total(self) -> int:
        return self.tp + self.replicated + self.expert


def _tp(*sizes: int) -> ParamSplit:
    return ParamSplit(tp=sum(sizes), largest_dense=max(sizes, default=0))


def _rep(*sizes: int) -> ParamSplit:
    return ParamSplit(replicated=sum(sizes), largest_dense=max(sizes, default=0))


def attention_params(cfg: Config) -> ParamSplit:
    m = cfg.model
    D, H = m.dim, m.n_heads
    if m.attention == "mla":
        Q, C = m.q_lora_rank, m.kv_lora_rank
        Dk, Dn, Dr, Dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        queries = (_rep(D * Q, Q) + _tp(Q * H * Dk)) if Q else _tp(D * H * Dk)
        return queries + _rep(D * (C + Dr), C) + _tp(C * H * (Dn + Dv), H * Dv * D)
    G, Dh = m.n_kv_heads or H, m.head_dim or D // H
    norms = _rep(Dh, Dh) if m.qk_norm else ParamSplit()
    return _tp(D * H * Dh, D * G * Dh, D * G * Dh, H * Dh * D) + norms


def ffn_params(cfg: Config, layer_id: int) -> ParamSplit:
    from moefold.models.transformer import is_moe_layer

    return _ffn_params(cfg, is_moe_layer(cfg, layer_id))


def _ffn_params(cfg: Config, moe_layer: bool) -> ParamSplit:
    m, moe = cfg.model, cfg.moe
    if not moe_layer:
        return _tp(m.dim * m.ffn_hidden, m.dim * m.ffn_hidden, m.ffn_hidden * m.dim)
    matrices = 3 if moe.activation == "swiglu" else 2
    expert_matrix = moe.num_experts * m.dim * moe.expert_hidden
    out = _rep(moe.num_experts * m.dim) + ParamSplit(expert=matrices * expert_matrix, largest_expert=expert_matrix)
    if moe.shared_experts:
        hidden = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden)
        out += _tp(*[m.dim * hidden] * matrices)
        if moe.shared_expert_gate:
            out += _rep(m.dim)
    return out


def layer_params(cfg: Config, layer_id: int) -> ParamSplit:
    """One block: two norms, attention, dense MLP or MoE layer."""
    from moefold.models.transformer import is_moe_layer

    return _block_params(cfg, is_moe_layer(cfg, layer_id))


def _block_params(cfg: Config, moe_layer: bool) -> ParamSplit:
    return _rep(cfg.model.dim, cfg.model.dim) + attention_params(cfg) + _ffn_params(cfg, moe_layer)


def moe_layer_count(cfg: Config) -> int:
    """How many blocks (MTP's included) are MoE layers."""
    return moe_layers_in(cfg, range(cfg.model.n_layers + cfg.model.mtp_layers))


def embedding_params(cfg: Config, vocab: int) -> ParamSplit:
    return _rep(vocab * cfg.model.dim)


def head_params(cfg: Config, vocab: int) -> ParamSplit:
    """Final norm, output head (none of its own when tied) and each MTP module without its block."""
    m = cfg.model
    head = _rep(m.dim) + (ParamSplit() if m.tie_embeddings else _rep(vocab * m.dim))
    return head + _rep(m.dim, m.dim, 2 * m.dim * m.dim, m.dim) * m.mtp_layers  # enorm, hnorm, eh_proj, norm


def model_params(cfg: Config, vocab: int) -> ParamSplit:
    """Every distinct parameter of the model (MTP blocks included)."""
    moe_blocks = moe_layer_count(cfg)
    dense_blocks = cfg.model.n_layers + cfg.model.mtp_layers - moe_blocks
    return (embedding_params(cfg, vocab) + head_params(cfg, vocab) + _block_params(cfg, True) * moe_blocks
            + _block_params(cfg, False) * dense_blocks)
