"""Saved-activation bytes of one micro-batch, module by module, from the config alone.

Each formula counts what moefold's code keeps for backward, op by op (the tensors autograd saves,
each storage once, parameters excluded), for GPU kernels: attention is a fused kernel (FlashAttention-2
/ cuDNN) that keeps q, k, v, the output and an fp32 log-sum-exp. `plan.measure` runs the real model
under FakeTensorMode and counts the same thing, and tests hold the two together category by
category. Rules that recur:

- RMSNorm computes in fp32: it keeps the fp32 input, the normalised fp32 rows and one rsqrt per
  row (8·d + 4 bytes a row), whatever the compute dtype; its output is kept by the next linear.
- Linears keep their input (shared by the q/k/v projections, which read one tensor).
- The router runs in fp32 on an fp32 copy of its input, and keeps fp32 scores [T, E].

Sizes are per rank: T tokens of the rank's micro-batch after context parallelism (B·S/cp); heads and
dense/shared hidden sizes divided by tp; norms, MLA down-projections and the output head are
replicated over TP (moefold's TP has no sequence parallelism); the MoE layer routes T/tp tokens per
rank (each TP rank dispatches its share of the tokens) and its experts see R rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefold.config import Config

CATEGORIES = ("embedding", "norm", "attn_proj", "attn_core", "mlp", "router", "moe_dispatch",
              "experts", "shared_experts", "mtp_proj", "head", "kept_inputs")
GATED = {"swiglu": True, "gelu": False, "relu2": False}
ROUTER_BYTES = {"fp32": 4, "fp64": 8}
INT64, FP32 = 8, 4


@dataclass(frozen=True)
class Shapes:
    """One rank's view of a micro-batch."""
    batch: int  # B sequences
    seq: int  # S tokens per sequence on this rank (seq_len / cp)
    tp: int
    ep: int
    etp: int
    act_bytes: int  # 2 for bf16 compute, 4 for fp32
    imbalance: float = 1.0  # rows of the busiest expert rank over the balanced share

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def fp32(self) -> bool:
        return self.act_bytes == 4


def norm_bytes(rows: int, dim: int, sh: Shapes) -> int:
    """RMSNorm: fp32 input copy, normalised fp32 rows, rsqrt per row; bf16 weights cast once."""
    return rows * (8 * dim + 4) + (0 if sh.fp32 else 4 * dim)


Bytes = dict[str, int]


def _add(into: Bytes, **parts: int) -> Bytes:
    for key, value in parts.items():
        into[key] = into.get(key, 0) + int(value)
    return into


def gqa_bytes(cfg: Config, sh: Shapes) -> Bytes:
    m, T, a = cfg.model, sh.tokens, sh.act_bytes
    H, G = m.n_heads // sh.tp, (m.n_kv_heads or m.n_heads) // sh.tp
    Dh = m.head_dim or m.dim // m.n_heads
    out = _add({}, attn_proj=T * m.dim * a)  # wo's input is a view of the attention output
    if m.qk_norm:
        _add(out, norm=norm_bytes(T * H, Dh, sh) + norm_bytes(T * G, Dh, sh))
    core = T * (2 * H + 2 * G) * Dh * a + T * H * FP32  # q, k, v, out, lse
    if m.sliding_window:
        core += sh.seq * sh.seq * a  # the window mask, as an attention bias in q's dtype
    return _add(out, attn_core=core)


def mla_bytes(cfg: Config, sh: Shapes) -> Bytes:
    m, T, a = cfg.model, sh.tokens, sh.act_bytes
    H, Q, C = m.n_heads // sh.tp, m.q_lora_rank, m.kv_lora_rank
    Dn, Dr, Dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    out = _add({}, attn_proj=T * (m.dim + Q + C) * a)  # x, wq_b's and wkv_b's (normed) inputs
    # In fp32 the latent norm keeps its input as it is: a view of wkv_a's [T, C + Dr] output.
    _add(out, norm=norm_bytes(T, C, sh) + (T * Dr * FP32 if sh.fp32 else 0))
    if Q:
        _add(out, norm=norm_bytes(T, Q, sh))
    # q and k are concatenations (nope | rope); v keeps wkv_b's whole [.., Dn + Dv] output alive.
    core = T * H * (2 * (Dn + Dr) + (Dn + Dv) + Dv) * a + T * H * FP32
    return _add(out, attn_core=core)


def dense_mlp_bytes(cfg: Config, sh: Shapes) -> Bytes:
    T, a = sh.tokens, sh.act_bytes
    return {"mlp": T * cfg.model.dim * a + 4 * T * (cfg.model.ffn_hidden // sh.tp) * a}


def expert_rows(cfg: Config, sh: Shapes) -> int:
    """R: rows one rank's experts compute. Balanced routing sends T/tp·K copies from every rank of
    the ep·etp group and spreads them over ep ranks; an etp group computes its rows together."""
    moe = cfg.moe
    copies = sh.tokens // sh.tp * moe.top_k * sh.etp
    factor = sh.imbalance
    if moe.pad_to_capacity:
        factor = max(factor, moe.capacity_factor)
    local_experts = moe.num_experts // sh.ep
    return int(copies * factor) + local_experts * (max(1, moe.pad_multiple) - 1)


def router_bytes(cfg: Config, sh: Shapes) -> int:
    moe, D = cfg.moe, cfg.model.dim
    T, K, E, r = sh.tokens // sh.tp, moe.top_k, moe.num_experts, ROUTER_BYTES[moe.router_dtype]
    total = T * D * r + T * E * r + T * K * INT64  # fp32 input, scores, chosen ids
    if not (sh.fp32 and r == FP32):
        total += E * D * r  # the weight cast to the router dtype
    if moe.input_jitter:
        total += T * D * r  # the noise
    mixtral_style = moe.score_func == "softmax" and not moe.softmax_before_topk
    if mixtral_style:
        total += T * E * r  # gather keeps the logits it picks from
    if moe.norm_topk_prob or mixtral_style:
        total += T * K * r  # the chosen probabilities, kept by the renormalising division
    if moe.norm_topk_prob:
        total += T * r
    # Group-limited selection keeps nothing: only its indices are used, which carry no gradient.
    return total + _balance_bytes(cfg, sh, T)


def _balance_bytes(cfg: Config, sh: Shapes, T: int) -> int:
    moe, E, B = cfg.moe, cfg.moe.num_experts, sh.batch
    total = 0
    if moe.score_func == "sigmoid" and (moe.aux_loss_coeff or moe.seq_aux_loss_coeff
                                        or moe.global_aux_loss_coeff):
        total += T * FP32  # the per-token sum that normalises sigmoid scores for balancing
    if moe.aux_loss_coeff:
        total += T + INT64 + E * FP32
    if moe.seq_aux_loss_coeff:
        total += T + B * INT64 + B * E * FP32 + INT64
    if moe.global_aux_loss_coeff:
        total += T + E * FP32 + INT64
    if moe.z_loss_coeff:
        total += T * E * FP32 + T * (FP32 + 1) + INT64
    return total


def _has_aux_loss(cfg: Config) -> bool:
    moe = cfg.moe
    return bool(moe.aux_loss_coeff or moe.seq_aux_loss_coeff or moe.global_aux_loss_coeff
                or moe.z_loss_coeff)


def dispatch_bytes(cfg: Config, sh: Shapes, rows: int) -> int:
    """Permutation indices and masks; without the memory-efficient permutation also the [T, K, D]
    expert outputs and [T, K] probabilities of the weighted combine."""
    moe, a = cfg.moe, sh.act_bytes
    T = sh.tokens // sh.tp
    N = T * moe.top_k
    total = rows * INT64 + (rows + 1) + N * INT64 + N  # gather index, row mask, combine index, keep
    if _has_aux_loss(cfg):
        total += FP32  # the summed aux loss, kept by the autograd function that injects it
    if moe.memory_efficient_permute:
        return total + rows * INT64  # the probabilities' gather index
    return total + N * cfg.model.dim * a + N * a


def experts_bytes(cfg: Config, sh: Shapes, rows: int) -> int:
    moe, a = cfg.moe, sh.act_bytes
    F = moe.expert_hidden // sh.etp
    gated = GATED[moe.activation]
    total = rows * cfg.model.dim * a + moe.num_experts // sh.ep * 4  # input rows, int32 offsets
    if moe.memory_efficient_permute:
        # gate, up and the activation output (kept by the down GEMM), and the [R] probabilities
        return total + (3 if gated else 2) * rows * F * a + rows * FP32
    return total + (4 if gated else 2) * rows * F * a


def shared_bytes(cfg: Config, sh: Shapes) -> int:
    moe, T, a, D = cfg.moe, sh.tokens, sh.act_bytes, cfg.model.dim
    F = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden) // sh.tp
    # In fp32 the input is the norm output the router already keeps.
    total = (0 if sh.fp32 else T * D * a) + (4 if GATED[moe.activation] else 2) * T * F * a
    if moe.shared_expert_gate:
        total += T * D * a + T * a
    return total


def moe_bytes(cfg: Config, sh: Shapes) -> Bytes:
    rows = expert_rows(cfg, sh)
    out = {"router": router_bytes(cfg, sh), "moe_dispatch": dispatch_bytes(cfg, sh, rows),
           "experts": experts_bytes(cfg, sh, rows)}
    if cfg.moe.shared_experts:
        out["shared_experts"] = shared_bytes(cfg, sh)
    return out


def layer_bytes(cfg: Config, layer_id: int, sh: Shapes) -> Bytes:
    """One transformer block (layer ids count on through the MTP blocks)."""
    from moefold.models.transformer import is_moe_layer

    out = _add({}, norm=2 * norm_bytes(sh.tokens, cfg.model.dim, sh))
    for part in (mla_bytes(cfg, sh) if cfg.model.attention == "mla" else gqa_bytes(cfg, sh),
                 moe_bytes(cfg, sh) if is_moe_layer(cfg, layer_id) else dense_mlp_bytes(cfg, sh)):
        _add(out, **part)
    return out


def rope_table_bytes(cfg: Config, sh: Shapes) -> int:
    m = cfg.model
    rope_dim = m.qk_rope_head_dim if m.attention == "mla" else (m.head_dim or m.dim // m.n_heads)
    return 2 * sh.seq * rope_dim * FP32  # cos and sin, shared by every layer of a stage


def head_bytes(cfg: Config, sh: Shapes, vocab: int) -> int:
    """Output head and loss: the head's input, fp32 log-probabilities, labels, the loss weight."""
    T = sh.tokens
    return T * cfg.model.dim * sh.act_bytes + T * vocab * FP32 + T * INT64 + FP32


def first_stage_bytes(cfg: Config, sh: Shapes) -> Bytes:
    return {"embedding": sh.tokens * INT64}


def last_stage_bytes(cfg: Config, sh: Shapes, vocab: int) -> Bytes:
    """Final norm and head, and each MTP module without its block (counted as a layer)."""
    T, D = sh.tokens, cfg.model.dim
    out = {"norm": norm_bytes(T, D, sh), "head": head_bytes(cfg, sh, vocab)}
    # In fp32 hnorm's input is the hidden state the previous norm (final or MTP) already keeps.
    hnorm_shared = T * D * FP32 if sh.fp32 else 0
    for _ in range(cfg.model.mtp_layers):
        _add(out, embedding=T * INT64, norm=3 * norm_bytes(T, D, sh) - hnorm_shared,
             mtp_proj=T * 2 * D * sh.act_bytes, head=head_bytes(cfg, sh, vocab))
    return out


def loss_workspace_bytes(sh: Shapes, vocab: int) -> int:
    """Transient at the loss: the logits in the compute dtype and their fp32 copy next to the kept
    log-probabilities (forward), or the fp32 and compute-dtype logit gradients (backward)."""
    return sh.tokens * vocab * (FP32 + sh.act_bytes)


def model_bytes(cfg: Config, sh: Shapes, vocab: int) -> Bytes:
    """The whole model on one pipeline stage (every layer, MTP included), by category."""
    out = _add({}, attn_core=rope_table_bytes(cfg, sh))
    for layer_id in range(cfg.model.n_layers + cfg.model.mtp_layers):
        _add(out, **layer_bytes(cfg, layer_id, sh))
    _add(out, **first_stage_bytes(cfg, sh))
    return _add(out, **last_stage_bytes(cfg, sh, vocab))
