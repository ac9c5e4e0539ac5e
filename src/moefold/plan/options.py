"""What `memory.recompute` and `memory.offload` take off one layer's saved activations.

Each name (memory/sites.py) wraps sites whose saved tensors we know from plan.activations:

- **recompute**: a checkpointed site keeps its inputs instead of what its ops saved (`moe`,
  `layer`, `attn_core`, `mlp`, `shared_experts`, the QK-norms); an output-discarding producer
  (`norm` before the attention / FFN, `moe_act` before the down GEMM, `mla_up_proj` before the core)
  keeps its input, and its output is freed where the consumer kept that very tensor.
- **offload**: the tensors saved inside the site's calls leave the GPU when they hold at least
  `memory.offload_min_bytes`; parameters and their dtype casts stay, and so do tensors a consumer
  outside the site also keeps (the attention output the output projection keeps, the expert
  activation the down GEMM keeps).

`layer_delta(cfg, layer_id, sh)` returns the change by category (negative: freed) and the bytes
moved to the host. A recomputed site's parameter casts (`weight_copies`) are made again in
backward, so they are freed too; offload leaves them on the device. Checked against the real model's saved bytes with the
wrappers applied (plan.measure on CPU, tests/unit/test_plan_memory.py; recompute and offload under
TP with and without sequence parallelism, tests/unit/test_plan_tp.py, where offload moves the local
shards of the DTensors that the sharded linears and sequence-parallel norms save).
"""

from __future__ import annotations

from moefold.config import Config
from moefold.plan import activations as act
from moefold.plan.activations import FP32, INT64, ROUTER_BYTES, Bytes, Shapes


def _gqa_dims(cfg: Config, sh: Shapes) -> tuple[int, int, int]:
    m = cfg.model
    return m.n_heads // sh.tp, (m.n_kv_heads or m.n_heads) // sh.tp, m.head_dim or m.dim // m.n_heads


def _norm_tensors(rows: int, dim: int) -> list[int]:
    """An RMSNorm's saved tensors that can move: fp32 input, normalised rows, rsqrt per row."""
    return [rows * dim * FP32, rows * dim * FP32, rows * FP32]


def _qk_norms(cfg: Config, sh: Shapes) -> list[tuple[int, int]]:
    if cfg.model.attention != "gqa" or not cfg.model.qk_norm:
        return []
    H, G, Dh = _gqa_dims(cfg, sh)
    return [(sh.tokens * H, Dh), (sh.tokens * G, Dh)]


def _core_inputs(cfg: Config, sh: Shapes) -> list[int]:
    """q, k, v storages the attention core keeps (MLA's v is a view of the kv up-projection)."""
    m, T, a = cfg.model, sh.tokens, sh.act_bytes
    if m.attention == "mla":
        H = m.n_heads // sh.tp
        qk = T * H * (m.qk_nope_head_dim + m.qk_rope_head_dim) * a
        return [qk, qk, T * H * (m.qk_nope_head_dim + m.v_head_dim) * a]
    H, G, Dh = _gqa_dims(cfg, sh)
    return [T * H * Dh * a, T * G * Dh * a, T * G * Dh * a]


def _core_internal(cfg: Config, sh: Shapes) -> list[int]:
    """What the core saves besides q, k, v and its output: log-sum-exp, a window's mask bias."""
    H = cfg.model.n_heads // sh.tp
    out = [sh.tokens * H * FP32]
    if cfg.model.attention == "gqa" and cfg.model.sliding_window:
        out.append(sh.seq * sh.seq * sh.act_bytes)
    return out


def _copies(cfg: Config, layer_id: int, sh: Shapes, *parts: str) -> int:
    by_part = act.weight_copies_by_part(cfg, layer_id, sh)
    return sum(by_part.get(p, 0) for p in parts)


def _pre_and_qk_norm_copies(cfg: Config, sh: Shapes) -> int:
    """fp32 casts of the pre-norm and QK-norm weights (bf16 parameters only)."""
    return act._cast(2 * cfg.model.dim + sum(d for _, d in _qk_norms(cfg, sh)), FP32, sh)


def _moe_tensors(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    """The MoE layer's large saved tensors (router input and scores, indices, expert rows)."""
    moe, D, a = cfg.moe, cfg.model.dim, sh.act_bytes
    T, F, r = sh.residual_tokens, moe.expert_hidden // sh.etp, ROUTER_BYTES[moe.router_dtype]
    N = sh.tokens // sh.tp * moe.top_k  # this TP rank's copies; the router routes T (T/tp under SP)
    gated = act.GATED[moe.activation]
    return [T * D * r, T * moe.num_experts * r, T * moe.top_k * INT64, rows * INT64,
            N * INT64, rows * D * a, *[rows * F * a] * (3 if gated else 2), rows * FP32]


def _small(sizes: list[int], min_bytes: int) -> int:
    return sum(s for s in sizes if s < min_bytes)


def _recompute(cfg: Config, name: str, layer_id: int, sh_params: Shapes, full: Bytes) -> Bytes:
    from moefold.models.transformer import is_moe_layer

    sh = act.block_shapes(cfg, layer_id, sh_params)  # activations; casts follow sh_params
    T, D, a = sh.tokens, cfg.model.dim, sh.act_bytes
    moe_layer = is_moe_layer(cfg, layer_id)
    x = T * D * a  # a sub-layer's input (all-gathered under sequence parallelism)
    if name == "layer":  # the block's input: this rank's share under sequence parallelism
        return act._add({k: -v for k, v in full.items()}, kept_inputs=sh.residual_tokens * D * a)
    if name == "moe" and moe_layer:  # its input: this rank's share under sequence parallelism
        parts = ("router", "moe_dispatch", "experts", "shared_experts")
        return act._add({k: -full.get(k, 0) for k in parts}, kept_inputs=sh.residual_tokens * D * a,
                        weight_copies=-_copies(cfg, layer_id, sh_params, "router", "experts", "shared"))
    if name == "mlp" and not moe_layer:
        return {"mlp": -full["mlp"], "kept_inputs": x,
                "weight_copies": -_copies(cfg, layer_id, sh_params, "mlp")}
    if name == "shared_experts" and moe_layer and cfg.moe.shared_experts:
        # The input is the normed x: with an fp32 one, the router keeps it already; under sequence
        # parallelism the all-gathered copy of it, in its own dtype.
        kept = T * D * sh.params if sh.seq_split > 1 else 0 if sh.fp32 or sh.input_copies else x
        return {"shared_experts": -full["shared_experts"], "kept_inputs": kept,
                "weight_copies": -_copies(cfg, layer_id, sh_params, "shared")}
    if name == "attn_core":
        kept = sh.seq * sh.seq if cfg.model.attention == "gqa" and cfg.model.sliding_window else 0
        return {"attn_core": -sum(_core_internal(cfg, sh)), "kept_inputs": kept}
    if name == "moe_act" and moe_layer:
        return {"experts": -act.expert_rows(cfg, sh) * (cfg.moe.expert_hidden // sh.etp) * a}
    if name == "mla_up_proj" and cfg.model.attention == "mla":
        return _recompute_mla_up_proj(cfg, sh, sh_params)
    if name == "norm":
        out = _recompute_norms(cfg, moe_layer, sh, not sh.input_copies)
        return act._add(out, weight_copies=-_pre_and_qk_norm_copies(cfg, sh_params))
    return {}


def _mla_up_proj_saved(cfg: Config, sh: Shapes) -> list[tuple[str, int]]:
    """What MLA's up-projection saves inside itself: the latent norms' internals and wq_b's /
    wkv_b's inputs (with q-LoRA off, wq's input is x: its own copy only with input copies)."""
    m, T, a = cfg.model, sh.tokens, sh.act_bytes
    Q, C, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    kv_in = T * C * FP32 if not sh.fp32 else 0  # in fp32 the input is the latent view itself
    out = [("norm", kv_in), ("norm", T * C * FP32), ("norm", T * FP32), ("attn_proj", T * C * a)]
    if Q:
        out += [("norm", T * Q * FP32), ("norm", T * Q * FP32), ("norm", T * FP32),
                ("attn_proj", T * Q * a)]
    elif sh.input_copies:
        out.append(("attn_proj", T * m.dim * a))
    if sh.fp32:
        out.append(("norm", T * (C + Dr) * FP32))  # the latent storage, norm input in fp32
    return out


def _recompute_mla_up_proj(cfg: Config, sh: Shapes, sh_params: Shapes) -> Bytes:
    """Output-discarding producer: its inputs (q_in and the [T, C + Dr] latent storage) stay,
    everything it saved and the q, k and kv outputs the core kept go (rebuilt in backward)."""
    m, T, a = cfg.model, sh.tokens, sh.act_bytes
    Q, C, Dr, H = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.n_heads // sh.tp
    out = act._add({}, attn_core=-sum(_core_inputs(cfg, sh)))
    for category, size in _mla_up_proj_saved(cfg, sh):
        act._add(out, **{category: -size})
    q_in = T * Q * a if Q else (T * m.dim * sh.params if sh.input_copies else 0)
    wq = Q * H * (m.qk_nope_head_dim + Dr) if Q else m.dim * H * (m.qk_nope_head_dim + Dr)
    copies = (act._cast(wq + C * H * (m.qk_nope_head_dim + m.v_head_dim), a, sh_params)
              + act._cast(C + Q, FP32, sh_params))
    return act._add(out, kept_inputs=q_in + T * (C + Dr) * a, weight_copies=-copies)


def _recompute_norms(cfg: Config, moe_layer: bool, sh: Shapes, same_dtype: bool) -> Bytes:
    """Pre-norms keep their input (the residual, this rank's share under sequence parallelism)
    instead of their internals; the consumer's copy of the normed x is freed when it kept that
    very tensor. QK-norms are checkpointed."""
    T, D, a, Tr = sh.tokens, cfg.model.dim, sh.act_bytes, sh.residual_tokens
    out = act._add({}, norm=2 * (-act.norm_bytes(Tr, D, sh) + Tr * D * a))
    for rows, dim in _qk_norms(cfg, sh):
        act._add(out, norm=-act.norm_bytes(rows, dim, sh) + rows * dim * a)
    if not same_dtype:  # the projections keep their own compute-dtype casts of the normed x
        return out
    if sh.seq_split > 1:  # sequence parallelism: they keep the all-gathered copy, not the norm's
        return out
    # Under TP, GQA attention and a dense MLP get the normed x wrapped as a DTensor by their input
    # plan (parallel/tensor.py): not the norm's output itself, so it is not freed. MLA reads it plain.
    wrapped = sh.tp > 1
    if not wrapped or cfg.model.attention == "mla":
        act._add(out, attn_proj=-T * D * a)
    if not moe_layer:
        return out if wrapped else act._add(out, mlp=-T * D * a)
    if sh.fp32 and ROUTER_BYTES[cfg.moe.router_dtype] == FP32:
        act._add(out, router=-T * D * FP32)  # the router's "copy" is the normed x itself
    if cfg.moe.shared_experts and not sh.fp32:
        act._add(out, shared_experts=-T * D * a)
    return out


def _offloaded(cfg: Config, name: str, layer_id: int, sh: Shapes, full: Bytes,
               min_bytes: int) -> Bytes:
    """Bytes by category that offloading `name` moves off the GPU (positive)."""
    from moefold.models.transformer import is_moe_layer

    sh = act.block_shapes(cfg, layer_id, sh)
    D, a = cfg.model.dim, sh.act_bytes
    moe_layer = is_moe_layer(cfg, layer_id)
    rows = act.expert_rows(cfg, sh) if moe_layer else 0
    pre_norms = [(sh.residual_tokens, D)] * 2
    if name == "norm":
        norms = [*pre_norms, *_qk_norms(cfg, sh)]
        return {"norm": sum(s for r, d in norms for s in _norm_tensors(r, d) if s >= min_bytes)}
    if name == "attn_core":
        return {"attn_core": sum(s for s in _core_inputs(cfg, sh) + _core_internal(cfg, sh)
                                 if s >= min_bytes)}
    if name == "moe_act" and moe_layer:
        F = cfg.moe.expert_hidden // sh.etp
        sizes = [rows * F * a] * (2 if act.GATED[cfg.moe.activation] else 1)
        if cfg.moe.memory_efficient_permute:
            sizes.append(rows * FP32)
        return {"experts": sum(s for s in sizes if s >= min_bytes)}
    if name in ("moe", "layer") and moe_layer or name == "layer":
        parts = ("router", "moe_dispatch", "experts", "shared_experts")
        if name == "layer":
            parts = tuple(k for k in full if k != "weight_copies")  # casts stay
        moved = {k: full.get(k, 0) for k in parts}
        stays = _small(_moe_tensors(cfg, sh, rows), min_bytes) if moe_layer else 0
        if name == "layer":
            norms = [*pre_norms, *_qk_norms(cfg, sh)]
            stays += _small([s for r, d in norms for s in _norm_tensors(r, d)], min_bytes)
            stays += _small(_core_inputs(cfg, sh) + _core_internal(cfg, sh), min_bytes)
        first = "router" if "router" in moved else next(iter(moved))
        moved[first] -= min(stays, moved[first])
        return moved
    if name == "mlp" and not moe_layer:
        return {"mlp": full["mlp"]}
    if name == "shared_experts" and moe_layer and cfg.moe.shared_experts:
        return {"shared_experts": full["shared_experts"]}
    if name == "mla_up_proj" and cfg.model.attention == "mla":
        # the per-head q, k, v stay (the core keeps them); what the up-projection saved moves
        moved: Bytes = {}
        for category, size in _mla_up_proj_saved(cfg, sh):
            if size >= min_bytes:
                act._add(moved, **{category: size})
        return moved
    return {}


def layer_delta(cfg: Config, layer_id: int, sh: Shapes) -> tuple[Bytes, int]:
    """(change of the layer's saved bytes by category, bytes moved to the host)."""
    full = act.layer_bytes(cfg, layer_id, sh)
    delta: Bytes = {}
    for name in cfg.memory.recompute:
        act._add(delta, **_recompute(cfg, name, layer_id, sh, full))
    host = 0
    for name in cfg.memory.offload:
        moved = _offloaded(cfg, name, layer_id, sh, full, cfg.memory.offload_min_bytes)
        act._add(delta, **{k: -v for k, v in moved.items()})
        host += sum(moved.values())
    return delta, host


def rope_offloaded(cfg: Config, sh: Shapes) -> int:
    """With whole layers offloaded, each layer's saved RoPE tables go too (the trunk's originals
    are freed once forward ends)."""
    table = act.rope_table_bytes(cfg, sh) // 2
    return 2 * table if "layer" in cfg.memory.offload and table >= cfg.memory.offload_min_bytes else 0
