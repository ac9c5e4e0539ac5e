"""What `memory.recompute` and `memory.offload` take off one layer's saved activations.

Each name (memory/sites.py) wraps sites whose saved tensors we know from plan.activations:

- **recompute**: a checkpointed site keeps its inputs instead of what its ops saved (`moe`,
  `layer`, `attn_core`, `mlp`, `shared_experts`, the QK-norms); an output-discarding producer
  (`norm` before the attention / FFN, `moe_act` before the down GEMM, `mla_up_proj` before the core)
  keeps its input, and its output is freed where the consumer kept that very tensor — with every
  other reference to that storage, a checkpoint's kept input among them. Inputs are kept in the
  dtype they arrive in: with fp32 parameters under autocast the residual stream and normed x are
  fp32.
- **offload**: each storage saved inside a site's call leaves the GPU when the tensors saved on
  it hold at least `memory.offload_min_bytes` (plan.activations lists a layer's storages one by
  one); parameters and their dtype casts stay, and so do storages a consumer outside the site also
  keeps (the attention output the output projection keeps, the expert activation the down GEMM
  keeps). The host holds one copy of each storage per call (memory/offload.py), those that stay
  on the GPU too.

`layer_delta(cfg, layer_id, sh)` returns the change by category (negative: freed) and the bytes
the layer's host copies hold. A recomputed site's parameter casts (`weight_copies`) are made again
in backward, so they are freed too; offload leaves them on the device. Names are planned one by
one: a site nested in another offloaded or recomputed one is not composed with it. Checked to the
byte against the real model's saved bytes and host copies with the wrappers applied (plan.measure
on CPU, tests/unit/test_plan_memory.py; recompute and offload under TP with and without sequence
parallelism, tests/unit/test_plan_tp.py, where offload moves the local shards of the DTensors that
the sharded linears and sequence-parallel norms save).
"""

from __future__ import annotations

from moefold.config import Config
from moefold.plan import activations as act
from moefold.plan.activations import FP32, Bytes, Shapes


def _gqa_dims(cfg: Config, sh: Shapes) -> tuple[int, int, int]:
    m = cfg.model
    return m.n_heads // sh.tp, (m.n_kv_heads or m.n_heads) // sh.tp, m.head_dim or m.dim // m.n_heads


def _qk_norms(cfg: Config, sh: Shapes) -> list[tuple[int, int]]:
    if cfg.model.attention != "gqa" or not cfg.model.qk_norm:
        return []
    H, G, Dh = _gqa_dims(cfg, sh)
    return [(sh.tokens * H, Dh), (sh.tokens * G, Dh)]


def _copies(cfg: Config, layer_id: int, sh: Shapes, *parts: str) -> int:
    by_part = act.weight_copies_by_part(cfg, layer_id, sh)
    return sum(by_part.get(p, 0) for p in parts)


def _pre_and_qk_norm_copies(cfg: Config, sh: Shapes) -> int:
    """fp32 casts of the pre-norm and QK-norm weights (bf16 parameters only)."""
    return act._cast(2 * cfg.model.dim + sum(d for _, d in _qk_norms(cfg, sh)), FP32, sh)


def _large(storages: list[int], min_bytes: int) -> int:
    """The bytes of the storages offload moves: those whose saved tensors hold at least
    offload_min_bytes each (a storage stays whole where a smaller view of it stays)."""
    return sum(s for s in storages if act.view_bytes(s) >= min_bytes)


def _recompute(cfg: Config, name: str, layer_id: int, sh_params: Shapes, full: Bytes) -> Bytes:
    from moefold.models.transformer import is_moe_layer

    sh = act.block_shapes(cfg, layer_id, sh_params)  # activations; casts follow sh_params
    T, D = sh.tokens, cfg.model.dim
    moe_layer = is_moe_layer(cfg, layer_id)
    # The residual stream and the normed x are in the parameters' dtype (fp32 ones under autocast
    # too): a checkpoint keeps a block's or an MoE layer's input as it is, this rank's share
    # under sequence parallelism; a dense MLP's, all-gathered.
    x = sh.residual_tokens * D * sh.params
    if name == "layer":
        return act._add({k: -v for k, v in full.items()}, kept_inputs=x)
    if name == "moe" and moe_layer:
        parts = ("router", "moe_dispatch", "experts", "shared_experts")
        return act._add({k: -full.get(k, 0) for k in parts}, kept_inputs=x,
                        weight_copies=-_copies(cfg, layer_id, sh_params, "router", "experts", "shared"))
    if name == "mlp" and not moe_layer:
        return {"mlp": -full["mlp"], "kept_inputs": T * D * sh.params,
                "weight_copies": -_copies(cfg, layer_id, sh_params, "mlp")}
    if name == "shared_experts" and moe_layer and cfg.moe.shared_experts:
        # The input is the normed x, which the router keeps already where it reads it as it is;
        # under sequence parallelism the all-gathered copy of it.
        shared = sh.seq_split == 1 and act.router_reads_normed_x(cfg, sh)
        return {"shared_experts": -full["shared_experts"], "kept_inputs": 0 if shared else T * D * sh.params,
                "weight_copies": -_copies(cfg, layer_id, sh_params, "shared")}
    if name == "attn_core":
        kept = sh.seq * sh.seq if cfg.model.attention == "gqa" and cfg.model.sliding_window else 0
        return {"attn_core": -sum(act.core_tensors(cfg, sh)[2]), "kept_inputs": kept}
    if name == "moe_act" and moe_layer:
        return _recompute_moe_act(cfg, sh)
    if name == "mla_up_proj" and cfg.model.attention == "mla":
        return _recompute_mla_up_proj(cfg, sh, sh_params)
    if name == "norm":
        out = _recompute_norms(cfg, moe_layer, sh)
        return act._add(out, weight_copies=-_pre_and_qk_norm_copies(cfg, sh_params))
    return {}


def _recompute_moe_act(cfg: Config, sh: Shapes) -> Bytes:
    """Output discarding frees the activation's output h, which the down GEMM kept, and what the
    activation saved besides its inputs (silu(gate) without the memory-efficient permutation). It
    keeps its inputs, the [R] probabilities among them, which the plain activation (no
    memory-efficient permutation) is handed but does not save."""
    rows, F, a = act.expert_rows(cfg, sh), cfg.moe.expert_hidden // sh.etp, sh.act_bytes
    if cfg.moe.memory_efficient_permute:
        return {"experts": -rows * F * a}
    silu = rows * F * a if act.GATED[cfg.moe.activation] else 0
    return {"experts": -rows * F * a - silu, "kept_inputs": rows * FP32}


def _mla_up_proj_saved(cfg: Config, sh: Shapes) -> list[tuple[str, int]]:
    """What MLA's up-projection saves inside itself: the latent norms' internals (on the residual
    stream's Tr tokens) and wq_b's / wkv_b's inputs (all T: under sequence parallelism the
    all-gathered latents). With q-LoRA off, wq's input is x: its own copy only with input copies,
    or all-gathered under sequence parallelism."""
    m, T, Tr, a = cfg.model, sh.tokens, sh.residual_tokens, sh.act_bytes
    Q, C, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    # The kv norm's fp32 input: in fp32 a view of the [Tr, C + Dr] latent storage, kept whole.
    kv_in = act.Viewed(Tr * (C + Dr) * FP32, Tr * C * FP32) if sh.fp32 else Tr * C * FP32
    out = [("norm", kv_in), ("norm", Tr * C * FP32), ("norm", Tr * FP32), ("attn_proj", T * C * a)]
    if Q:
        out += [("norm", Tr * Q * FP32), ("norm", Tr * Q * FP32), ("norm", Tr * FP32),
                ("attn_proj", T * Q * a)]
    elif sh.input_copies or Tr < T:
        out.append(("attn_proj", T * m.dim * a))
    return out


def _recompute_mla_up_proj(cfg: Config, sh: Shapes, sh_params: Shapes) -> Bytes:
    """Output-discarding producer: its inputs (q_in and the [Tr, C + Dr] latent storage, and under
    sequence parallelism the all-gathered [T, Dr] RoPE key) stay, everything it saved and the q, k
    and kv outputs the core kept go (rebuilt in backward)."""
    m, T, Tr, a = cfg.model, sh.tokens, sh.residual_tokens, sh.act_bytes
    Q, C, Dr, H = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.n_heads // sh.tp
    out = act._add({}, attn_core=-sum(act.core_tensors(cfg, sh)[0]))
    for category, size in _mla_up_proj_saved(cfg, sh):
        act._add(out, **{category: -size})
    q_in = Tr * Q * a if Q else (Tr * m.dim * sh.params if sh.input_copies else 0)
    rope_key = T * Dr * a if Tr < T else 0  # else a view of the latent storage
    wq = Q * H * (m.qk_nope_head_dim + Dr) if Q else m.dim * H * (m.qk_nope_head_dim + Dr)
    copies = (act._cast(wq + C * H * (m.qk_nope_head_dim + m.v_head_dim), a, sh_params)
              + act._cast(C + Q, FP32, sh_params))
    return act._add(out, kept_inputs=q_in + Tr * (C + Dr) * a + rope_key, weight_copies=-copies)


def _recompute_norms(cfg: Config, moe_layer: bool, sh: Shapes) -> Bytes:
    """Pre-norms keep their input (the residual, in the parameters' dtype; this rank's share under
    sequence parallelism) instead of their internals; the consumers' references to the normed x
    are freed where they kept that very tensor (`_freed_norm_outputs`). QK-norms are
    checkpointed."""
    D, a, Tr = cfg.model.dim, sh.act_bytes, sh.residual_tokens
    out = act._add({}, norm=2 * (-act.norm_bytes(Tr, D) + Tr * D * sh.params))
    for rows, dim in _qk_norms(cfg, sh):
        act._add(out, norm=-act.norm_bytes(rows, dim) + rows * dim * a)
    return act._add(out, **_freed_norm_outputs(cfg, moe_layer, sh))


def _freed_norm_outputs(cfg: Config, moe_layer: bool, sh: Shapes) -> Bytes:
    """The normed x that output discarding frees where the consumer takes it itself: every
    reference to that storage goes, what a consumer saved and a recomputed site's kept input alike,
    charged to the one holder the plan counts it in. Under TP, GQA attention and a dense MLP get it
    wrapped as a DTensor by their input plan (parallel/tensor.py), all-gathered under sequence
    parallelism: not the norm's output itself, so nothing is freed there. MLA reads it as it is
    (the rank's shard under sequence parallelism); MoE layers too, but under sequence parallelism
    (their input hook's `to_local()` of the shard keeps it)."""
    x, names = sh.residual_tokens * cfg.model.dim * sh.params, cfg.memory.recompute
    out: Bytes = {}
    if sh.tp == 1 or cfg.model.attention == "mla":
        holder = _attn_input_holder(cfg, sh, names)
        if holder:
            out[holder] = -x
    if moe_layer and sh.seq_split == 1 or sh.tp == 1:
        holder = _ffn_input_holder(cfg, moe_layer, sh, names)
        if holder:
            act._add(out, **{holder: -x})
    return out


def _attn_input_holder(cfg: Config, sh: Shapes, names: list[str]) -> str:
    """The category the attention's normed x is counted in ("" where nothing keeps it): its
    projections read it as it is, unless each keeps its own compute-dtype cast (input copies);
    then MLA's recomputed up-projection keeps it as its input, where wq reads it (no q-LoRA)."""
    if not sh.input_copies:
        return "attn_proj"
    mla = cfg.model.attention == "mla" and not cfg.model.q_lora_rank
    return "kept_inputs" if mla and "mla_up_proj" in names else ""


def _ffn_input_holder(cfg: Config, moe_layer: bool, sh: Shapes, names: list[str]) -> str:
    """The category the FFN's normed x is counted in ("" where nothing keeps it): a recomputed
    MLP or MoE layer's kept input; a router that reads it as it is; recomputed shared experts' kept
    input; else the MLP or shared experts, reading it as it is (no input copies)."""
    if not moe_layer:
        return "kept_inputs" if "mlp" in names else "" if sh.input_copies else "mlp"
    if "moe" in names:
        return "kept_inputs"
    if act.router_reads_normed_x(cfg, sh):
        return "router"
    if not cfg.moe.shared_experts:
        return ""
    if "shared_experts" in names:
        return "kept_inputs"
    return "" if sh.input_copies else "shared_experts"


# Whole modules: what a call saves is their categories' storages (in the layers that have them).
_MODULE_PARTS = {"moe": ("router", "moe_dispatch", "experts", "shared_experts"), "mlp": ("mlp",),
                 "shared_experts": ("shared_experts",)}


def _site_storages(cfg: Config, name: str, layer_id: int, sh_params: Shapes) -> act.Tensors:
    """By category, the storages a call of the site `name` saves and no consumer outside it keeps:
    offload takes them off the GPU."""
    sh = act.block_shapes(cfg, layer_id, sh_params)
    tensors = act.layer_tensors(cfg, layer_id, sh_params)
    if name == "layer":
        return tensors
    if name in _MODULE_PARTS:
        return {k: tensors[k] for k in _MODULE_PARTS[name] if k in tensors}
    if name == "norm":
        norms = [(sh.residual_tokens, cfg.model.dim)] * 2 + _qk_norms(cfg, sh)
        return {"norm": [s for rows, dim in norms for s in act.norm_tensors(rows, dim)]}
    if name == "attn_core":  # the output stays: the output projection keeps it
        qkv, _, internal = act.core_tensors(cfg, sh)
        return {"attn_core": qkv + internal}
    if name == "moe_act" and "experts" in tensors:  # its output h stays: the down GEMM keeps it
        return {"experts": act.activation_tensors(cfg, sh, act.expert_rows(cfg, sh))}
    if name == "mla_up_proj" and cfg.model.attention == "mla":  # q, k, v stay: the core keeps them
        out: act.Tensors = {}
        for category, size in _mla_up_proj_saved(cfg, sh):
            out.setdefault(category, []).append(size)
        return out
    return {}


def _copied_but_kept(cfg: Config, name: str, layer_id: int, sh_params: Shapes) -> list[int]:
    """Storages a call of the site `name` copies to the host though they stay on the GPU (offload
    copies each storage saved in a call once, memory/offload.py): the attention output, which the
    output projection keeps; the normed x that shared experts read where the router keeps it, and
    that MLA's wq reads without q-LoRA (wkv_a keeps it); the RoPE tables, which the trunk holds
    until forward ends."""
    from moefold.models.transformer import is_moe_layer

    sh = act.block_shapes(cfg, layer_id, sh_params)
    x = [sh.tokens * cfg.model.dim * sh.act_bytes]
    if name == "attn_core":
        return [act.core_tensors(cfg, sh)[1]]
    if name == "mla_up_proj" and cfg.model.attention == "mla" and not cfg.model.q_lora_rank:
        # Under sequence parallelism wq keeps its own all-gathered x, which goes.
        return _rope_tables(cfg, sh) + ([] if sh.input_copies or sh.seq_split > 1 else x)
    if name == "shared_experts" and is_moe_layer(cfg, layer_id) and cfg.moe.shared_experts:
        read = not sh.input_copies and sh.seq_split == 1 and act.router_reads_normed_x(cfg, sh)
        return x if read else []
    return _rope_tables(cfg, sh) if name in _rope_sites(cfg) else []


def _offloaded(cfg: Config, name: str, layer_id: int, sh: Shapes, min_bytes: int) -> tuple[Bytes, int]:
    """Bytes by category that offloading `name` takes off the GPU (positive), and the bytes of
    its host copies."""
    moved = {k: _large(v, min_bytes) for k, v in _site_storages(cfg, name, layer_id, sh).items()}
    return moved, sum(moved.values()) + _large(_copied_but_kept(cfg, name, layer_id, sh), min_bytes)


def layer_delta(cfg: Config, layer_id: int, sh: Shapes) -> tuple[Bytes, int]:
    """(change of the layer's saved bytes by category, bytes its offload holds on the host)."""
    full = act.layer_bytes(cfg, layer_id, sh)
    delta: Bytes = {}
    for name in cfg.memory.recompute:
        act._add(delta, **_recompute(cfg, name, layer_id, sh, full))
    host = 0
    for name in cfg.memory.offload:
        moved, copied = _offloaded(cfg, name, layer_id, sh, cfg.memory.offload_min_bytes)
        act._add(delta, **{k: -v for k, v in moved.items()})
        host += copied
    return delta, host


def _rope_sites(cfg: Config) -> tuple[str, ...]:
    """The sites that apply RoPE, saving the tables: the whole layer, and MLA's up-projection."""
    return ("layer", "mla_up_proj") if cfg.model.attention == "mla" else ("layer",)


def _rope_tables(cfg: Config, sh: Shapes) -> list[int]:
    """cos and sin as a layer saves them: DeepSeek's interleaved RoPE reads the first half of each
    (rope.apply_rope_interleaved)."""
    table = act.rope_table_bytes(cfg, sh) // 2
    half = cfg.model.attention == "mla" and cfg.model.rope_interleaved
    return [act.Viewed(table, table // 2 if half else table)] * 2


def rope_offloaded(cfg: Config, sh: Shapes) -> int:
    """Where every layer's site that applies RoPE is offloaded, each layer's call copies the tables
    it saved, and the trunk's originals are freed once forward ends."""
    if not set(_rope_sites(cfg)) & set(cfg.memory.offload):
        return 0
    return _large(_rope_tables(cfg, sh), cfg.memory.offload_min_bytes)
