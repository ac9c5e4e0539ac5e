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

import math
from dataclasses import dataclass

from moefold.config import Config
from moefold.models.transformer import moe_layers_in


@dataclass(frozen=True)
class ParamSplit:
    tp: int = 0
    replicated: int = 0
    expert: int = 0

    def __add__(self, other: ParamSplit) -> ParamSplit:
        return ParamSplit(self.tp + other.tp, self.replicated + other.replicated, self.expert + other.expert)

    def __mul__(self, copies: int) -> ParamSplit:
        """`copies` modules of this split."""
        return ParamSplit(self.tp * copies, self.replicated * copies, self.expert * copies)

    @property
    def total(self) -> int:
        return self.tp + self.replicated + self.expert


def _tp(*sizes: int) -> ParamSplit:
    return ParamSplit(tp=sum(sizes))


def _rep(*sizes: int) -> ParamSplit:
    return ParamSplit(replicated=sum(sizes))


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
    out = _rep(moe.num_experts * m.dim) + ParamSplit(expert=matrices * expert_matrix)
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


# ------------------------------------------------------------------- fp8 moments' block scales

@dataclass(frozen=True)
class Weight:
    """A parameter as PrecisionAwareAdamW's fp8 blocks see it (optim/blocks.py): `rows` (the
    product of its leading dims) by `cols` (its last dim), the ParallelDims sizes that split its
    rows (the first one dim 0, of `lead` rows in an expert's 3-D tensor) and the one that splits
    its columns; a `vector` (1-D) has the data ranks split its one dim."""
    rows: int
    cols: int
    row_split: tuple[str, ...] = ()
    col_split: str = ""
    expert: bool = False
    vector: bool = False
    lead: int = 0  # dim 0 of a 3-D tensor; 0: a 2-D one, whose dim 0 is `rows`


def _vectors(*sizes: int) -> list[Weight]:
    return [Weight(1, n, vector=True) for n in sizes]


def _attention_weights(cfg: Config) -> list[Weight]:
    """Column-wise linears' rows split by tp, row-wise ones' columns (parallel/tp_split.py)."""
    m = cfg.model
    D, H = m.dim, m.n_heads
    if m.attention == "mla":
        Q, C, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        Dk, Dn, Dv = m.qk_nope_head_dim + Dr, m.qk_nope_head_dim, m.v_head_dim
        queries = ([Weight(Q, D), *_vectors(Q), Weight(H * Dk, Q, ("tp",))] if Q
                   else [Weight(H * Dk, D, ("tp",))])
        return [*queries, Weight(C + Dr, D), *_vectors(C), Weight(H * (Dn + Dv), C, ("tp",)),
                Weight(D, H * Dv, col_split="tp")]
    G, Dh = m.n_kv_heads or H, m.head_dim or D // H
    norms = _vectors(Dh, Dh) if m.qk_norm else []
    return [Weight(H * Dh, D, ("tp",)), *[Weight(G * Dh, D, ("tp",))] * 2, Weight(D, H * Dh, col_split="tp"), *norms]


def _ffn_weights(cfg: Config, moe_layer: bool) -> list[Weight]:
    m, moe = cfg.model, cfg.moe
    if not moe_layer:
        return [Weight(m.ffn_hidden, m.dim, ("tp",))] * 2 + [Weight(m.dim, m.ffn_hidden, col_split="tp")]
    gated = moe.activation == "swiglu"  # w3 beside w1
    E, D, F = moe.num_experts, m.dim, moe.expert_hidden
    w1_EDF = Weight(E * D, F, ("ep",), "etp", expert=True, lead=E)
    out = [Weight(E, D), *[w1_EDF] * (1 + gated), Weight(E * F, D, ("ep", "etp"), expert=True, lead=E)]
    if moe.shared_experts:
        hidden = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden)
        out += [Weight(hidden, D, ("tp",))] * (1 + gated) + [Weight(D, hidden, col_split="tp")]
        if moe.shared_expert_gate:
            out.append(Weight(1, D))
    return out


def block_weights(cfg: Config, moe_layer: bool) -> list[Weight]:
    """A dense (MoE) block's parameters (`layer_params`), tensor by tensor."""
    D = cfg.model.dim
    return [*_vectors(D, D), *_attention_weights(cfg), *_ffn_weights(cfg, moe_layer)]


def embedding_weights(cfg: Config, vocab: int) -> list[Weight]:
    return [Weight(vocab, cfg.model.dim)]


def head_weights(cfg: Config, vocab: int) -> list[Weight]:
    """`head_params`, tensor by tensor."""
    m = cfg.model
    head = [] if m.tie_embeddings else [Weight(vocab, m.dim)]
    mtp = [*_vectors(m.dim, m.dim), Weight(m.dim, 2 * m.dim), *_vectors(m.dim)]  # enorm, hnorm, eh_proj, norm
    return [*_vectors(m.dim), *head, *mtp * m.mtp_layers]


def local_shape(w: Weight, dims) -> tuple[int, int, int]:
    """(dim 0, rows, cols) of `w`'s local tensor (after TP, EP and ETP): rows over every dim but the
    last (an expert weight's local experts times their rows), dim 0 its local experts (or its rows)."""
    rows = w.rows // math.prod(getattr(dims, name) for name in w.row_split)
    cols = w.cols // getattr(dims, w.col_split) if w.col_split else w.cols
    lead = w.lead // getattr(dims, w.row_split[0]) if w.lead else rows
    return lead, rows, cols


def busiest_rows(lead: int, rows: int, data_ranks: int) -> int:
    """Rows (the product of the leading dims) of a local tensor [lead, rows / lead, cols] that the
    first of `data_ranks` holds, the busiest: dim 0 is cut as torch.chunk cuts it (FSDP2's Shard(0),
    ZeRO-1's shard), ceil(lead / ranks) on the first ranks (22 of 64 rows over 3), unless it does
    not split evenly and an expert weight's dim 1 does, which is cut instead, evenly
    (parallel/data.py's `even_expert_shards`, parallel/zero.py's `shard_dim`)."""
    if lead % data_ranks and (rows // lead) % data_ranks == 0:
        return rows // data_ranks
    return -(-lead // data_ranks) * (rows // lead)


def busiest_elements(w: Weight, dims, data_ranks: int, zero1: bool) -> int:
    """Elements of `w` that the busiest (first) of its `data_ranks` keeps of a sharded state (the
    parameter and gradient under FSDP2, the moments and remainder under FSDP2 and ZeRO-1): a
    vector's ceil(n / ranks); a matrix's `busiest_rows`, or, under ZeRO-1 (`zero1`) where no
    leading dim splits evenly and the last one does, an even share of the columns
    (parallel/zero.py's `shard_dim`: the tiny models' 257-row embedding)."""
    if w.vector:
        return -(-w.cols // data_ranks)
    lead, rows, cols = local_shape(w, dims)
    leading_uneven = lead % data_ranks and (rows // lead) % data_ranks
    if zero1 and leading_uneven and cols % data_ranks == 0:
        return rows * cols // data_ranks
    return busiest_rows(lead, rows, data_ranks) * cols


def local_scale_blocks(w: Weight, dims, data_ranks: int, zero1: bool) -> float:
    """fp32 scales the busiest data rank keeps per fp8 moment of `w` (optim/blocks.py's
    `scale_like`): a block of BLOCK columns per row, a row's last one whole however short. A split
    of the columns into pieces of whole blocks splits the scales with them; one that cuts blocks
    leaves every rank the whole rows' scales. Data ranks split a matrix's rows (`busiest_rows`), a
    vector's columns, and under ZeRO-1 (`zero1`) a matrix's columns where no leading dim divides
    evenly (parallel/zero.py's `shard_dim`: the tiny models' 257-row embedding)."""
    from moefold.optim.blocks import BLOCK, pieces_hold_whole_blocks

    lead, rows, _ = local_shape(w, dims)
    cols = w.cols
    if w.col_split and pieces_hold_whole_blocks(cols, getattr(dims, w.col_split)):
        cols = -(-cols // getattr(dims, w.col_split))
    leading_uneven = lead % data_ranks and (rows // lead) % data_ranks  # dim 0, and an expert's dim 1
    if w.vector or zero1 and leading_uneven and cols % data_ranks == 0:
        if pieces_hold_whole_blocks(cols, data_ranks):
            cols = -(-cols // data_ranks)
        return rows * -(-cols // BLOCK)
    return busiest_rows(lead, rows, data_ranks) * -(-cols // BLOCK)
