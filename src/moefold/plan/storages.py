"""Who keeps each storage one block saves for backward: what memory.recompute and memory.offload
act on (plan.options applies them).

A storage is one of plan.activations' (`layer_tensors`, the weight copies, the RoPE tables) and
with it:

- `saved_in`: the site calls (memory/sites.py) around each op that saves a tensor on it, outermost
  first: ("layer", "moe", "moe_act") is the routed experts' activation. The innermost *wrapped*
  call decides what becomes of that reference, since only the innermost saved-tensor hooks run: a
  recomputed call saves a placeholder, an offloaded one a host copy (or the tensor itself where it
  stays on the device); outside any the tensor stays.
- `input_of`: the checkpointed calls that keep it as a positional input when recomputed:
  torch.utils.checkpoint (non-reentrant) saves those through the saved-tensor hooks around its
  call, so they go the way of a tensor an op saved there (to the host inside an offloaded call).
- `held_by`: the recomputed calls that hold it themselves: an output-discarding producer's inputs,
  a checkpoint's keyword arguments (its recompute closure holds them).
- `output_of`: the output-discarding producer whose recompute frees it, every reference with it
  (the consumer takes that tensor or a view of it, a DTensor around it among them; not a copy).

A storage with several roles is one object: the normed x that a pre-norm makes, the router and the
shared experts save and a recomputed MoE layer keeps; the attention output that the core and the
output projection save; the expert activation's output that the down GEMM saves. Nested and
neighbouring sites share these, which is why plan.options composes the names storage by storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moefold.config import Config
from moefold.plan import activations as act
from moefold.plan.activations import FP32, Shapes

Call = tuple[str, ...]  # the site calls around an op, outermost first
LAYER: Call = ("layer",)
ATTN_NORM, FFN_NORM, Q_NORM, K_NORM = (LAYER + (f"norm.{which}",) for which in ("attn", "ffn", "q", "k"))
CORE, UP_PROJ, MOE, MLP = (LAYER + (name,) for name in ("attn_core", "mla_up_proj", "moe", "mlp"))
MOE_ACT, SHARED = MOE + ("moe_act",), MOE + ("shared_experts",)


def site(call: Call) -> str:
    """The memory.recompute / memory.offload name of a call ("norm.ffn" is a "norm" site)."""
    return call[-1].partition(".")[0]


@dataclass(eq=False)
class Stored:
    """One storage and who keeps it (see the module docstring)."""
    nbytes: int  # the whole storage's, also where the tensors saved on it are a smaller view
    category: str  # where it counts while an op's reference to it stays on the device
    saved_in: list[Call] = field(default_factory=list)
    input_of: list[Call] = field(default_factory=list)
    held_by: list[Call] = field(default_factory=list)
    output_of: Call | None = None
    weight: bool = False  # a parameter's cast: offload leaves it on the device
    saved_as: dict[int, str] = field(default_factory=dict)  # saved_in[i]'s category, where another

    def saved(self, *calls: Call, category: str = "") -> Stored:
        for call in calls:
            if category and self.category and category != self.category:
                self.saved_as[len(self.saved_in)] = category
            self.saved_in.append(call)
        self.category = self.category or category
        return self

    def category_of(self, i: int) -> str:
        """The category of the reference saved_in[i] takes: where the storage counts when it is
        the first that stays on the device (plan.measure charges a storage to its first saver)."""
        return self.saved_as.get(i, self.category)


def _saved(sizes: list[int], category: str, call: Call) -> list[Stored]:
    return [Stored(size, category, [call]) for size in sizes]


def block_storages(cfg: Config, layer_id: int, sh_params: Shapes) -> list[Stored]:
    """The storages of one block (layer ids count on through the MTP blocks), its weight copies
    included and the RoPE tables not (`rope_tables`: one pair for all blocks of a stage)."""
    from moefold.models.transformer import is_moe_layer

    sh = act.block_shapes(cfg, layer_id, sh_params)
    tensors = act.layer_tensors(cfg, layer_id, sh_params)
    moe_layer = is_moe_layer(cfg, layer_id)
    # Output discarding frees a pre-norm's output where the consumer takes its memory: the tensor
    # or a view of it (under TP the DTensor that GQA attention's or a dense MLP's input plan wraps
    # around it; under SP MLA's shard as it is, an MoE layer's `to_local()` of it). Not where
    # GQA attention and dense MLPs all-gather it under SP.
    gathered = sh.seq_split > 1
    attn_norm, attn_x = _pre_norm(cfg, sh, tensors["norm"][:3], ATTN_NORM,
                                  frees=not gathered or cfg.model.attention == "mla")
    ffn_norm, ffn_x = _pre_norm(cfg, sh, tensors["norm"][3:6], FFN_NORM, frees=not gathered or moe_layer)
    attn_norm[0].input_of.append(LAYER)  # the block's input, which a recomputed block keeps
    attention = (_mla if cfg.model.attention == "mla" else _gqa)(cfg, sh, tensors, attn_x)
    ffn = _moe(cfg, sh, tensors, ffn_x) if moe_layer else _dense_mlp(cfg, sh, tensors, ffn_x)
    out = attn_norm + ffn_norm + attention + ffn + _weight_copies(cfg, layer_id, sh_params, moe_layer)
    return [s for s in {id(s): s for s in out}.values() if s.saved_in or s.input_of or s.held_by]


def rope_tables(cfg: Config, sh: Shapes) -> list[Stored]:
    """cos and sin as a block keeps them, RoPE applied in the block (GQA) or MLA's up-projection
    (DeepSeek's interleaved RoPE saves the first half of each, rope.apply_rope_interleaved). The
    trunk makes them once per stage and lets them go when forward ends: only blocks keep them."""
    table = act.rope_table_bytes(cfg, sh) // 2
    applied_in, held_by = (UP_PROJ, [UP_PROJ]) if cfg.model.attention == "mla" else (LAYER, [])
    return [Stored(table, "attn_core", [applied_in], [LAYER], list(held_by)) for _ in "cs"]


def _pre_norm(cfg: Config, sh: Shapes, norm: list[int], call: Call, frees: bool) -> tuple[list[Stored], Stored]:
    """A pre-norm's storages, its input (the residual stream, this rank's share, in the
    parameters' dtype: its fp32 input itself when the stream is fp32) first; and its output, the
    normed x, which output discarding frees where `frees`."""
    fp32_in, rows, rsqrt = norm
    residual = Stored(sh.residual_tokens * cfg.model.dim * sh.params, "norm", held_by=[call])
    cast = [] if sh.params == FP32 else [Stored(fp32_in, "norm")]
    storages = [residual, *cast, *_saved([rows, rsqrt], "norm", call)]
    (cast or [residual])[0].saved(call)
    normed_x = Stored(residual.nbytes, "", output_of=call if frees else None)
    return storages, normed_x


def _gathered(cfg: Config, sh: Shapes, normed_x: Stored) -> Stored:
    """The normed x as the attention, a dense MLP or shared experts read it: under sequence
    parallelism an all-gathered copy of the T tokens."""
    return normed_x if sh.seq_split == 1 else Stored(sh.tokens * cfg.model.dim * sh.params, "")


def _read_as_is(x: Stored, size: int, category: str, *calls: Call) -> Stored:
    """The normed x, which linears save as it is where they keep no copies of their own."""
    assert int(size) == x.nbytes, (int(size), x.nbytes)
    return x.saved(*calls, category=category)


def _gqa(cfg: Config, sh: Shapes, tensors: act.Tensors, attn_x: Stored) -> list[Stored]:
    """q, k and v read the normed x in the block (each its own cast with input copies); each
    QK-norm is a call of its own, checkpointed when recomputed."""
    x, proj = _gathered(cfg, sh, attn_x), tensors["attn_proj"]
    if sh.input_copies:
        out = _saved(proj, "attn_proj", LAYER)
    else:
        out = [_read_as_is(x, proj[0], "attn_proj", LAYER)]
    qk = tensors["norm"][6:]
    for call, (fp32_in, rows, rsqrt) in ((Q_NORM, qk[0:3]), (K_NORM, qk[3:6])) if qk else ():
        # The projection's output is the checkpoint's input, and in fp32 the norm's fp32 input.
        projected = Stored(fp32_in // FP32 * sh.act_bytes, "norm", input_of=[call])
        cast = [] if sh.fp32 else [Stored(fp32_in, "norm")]
        (cast or [projected])[0].saved(call)
        out += [projected, *cast, *_saved([rows, rsqrt], "norm", call)]
    q, k, v, output, *internal = tensors["attn_core"]
    qkv = [Stored(s, "attn_core", [CORE], [CORE]) for s in (q, k, v)]
    return out + qkv + _core_rest(cfg, sh, output, internal)


def _core_rest(cfg: Config, sh: Shapes, output: int, internal: list[int]) -> list[Stored]:
    """The attention output, which the output projection saves too; the log-sum-exp (and a
    sliding window's bias, whose bool mask a recomputed core keeps)."""
    out = [Stored(output, "attn_core", [CORE]).saved(LAYER, category="attn_proj"),
           *_saved(internal, "attn_core", CORE)]
    if act.window_masked(cfg):
        out.append(Stored(sh.seq * sh.seq, "", held_by=[CORE]))  # a keyword argument
    return out


def _mla(cfg: Config, sh: Shapes, tensors: act.Tensors, attn_x: Stored) -> list[Stored]:
    """wq_a (with q-LoRA) and wkv_a read the normed x as it is (the rank's shard under SP) in the
    block, wq in the up-projection without q-LoRA (under SP an all-gathered copy of its own). The
    up-projection keeps q_in, the [Tr, C + Dr] latent storage (in fp32 the latent norms' inputs
    themselves) and under SP the all-gathered RoPE key as its inputs, and makes q, k and kv, which
    the core saves and its recompute keeps (v is a view of kv)."""
    m, T, Tr, a = cfg.model, sh.tokens, sh.residual_tokens, sh.act_bytes
    Q, C, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    wq_in = LAYER if Q else UP_PROJ
    wq_x, wkv_x, up_inputs = act.mla_proj_inputs(cfg, sh)  # tensors["attn_proj"], in parts
    if sh.input_copies or len(wkv_x) > 1:  # its own cast, or (SP) its own FP8 copy and scales
        out = _saved(wkv_x, "attn_proj", LAYER)
    else:
        out = [_read_as_is(attn_x, wkv_x[0], "attn_proj", LAYER, *([] if wq_x else [wq_in]))]
    out += _saved(wq_x, "attn_proj", wq_in)
    out += _saved(up_inputs, "attn_proj", UP_PROJ)  # wq_b's and wkv_b's
    kv_norm, q_norm = tensors["norm"][6:9], tensors["norm"][9:]
    out += _latent_norm(sh, kv_norm, Tr * (C + Dr) * a)
    if Q:
        out += _latent_norm(sh, q_norm, Tr * Q * a)
    else:
        attn_x.held_by.append(UP_PROJ)  # q_in is x itself
        out.append(attn_x)
    if Tr < T:  # the all-gathered RoPE key (else a view of the latent storage)
        out.append(Stored(T * Dr * a, "", held_by=[UP_PROJ]))
    q, k, kv, output, *internal = tensors["attn_core"]
    qkv = [Stored(s, "attn_core", [CORE], [CORE], output_of=UP_PROJ) for s in (q, k, kv)]
    return out + qkv + _core_rest(cfg, sh, output, internal)


def _latent_norm(sh: Shapes, norm: list[int], latent: int) -> list[Stored]:
    """A latent norm in the up-projection: its fp32 input is the up-projection's input (the
    latent) itself in fp32, a cast of it otherwise."""
    fp32_in, rows, rsqrt = norm
    kept = Stored(fp32_in if sh.fp32 else latent, "norm", held_by=[UP_PROJ])
    cast = [] if sh.fp32 else [Stored(fp32_in, "norm")]
    (cast or [kept])[0].saved(UP_PROJ)
    return [kept, *cast, *_saved([rows, rsqrt], "norm", UP_PROJ)]


def _moe(cfg: Config, sh: Shapes, tensors: act.Tensors, ffn_x: Stored) -> list[Stored]:
    """The router reads the normed x as it is where it is in the router's dtype, and a recomputed
    MoE layer keeps it; the shared experts are a call of their own."""
    router = tensors["router"]
    reads_x = act.router_reads_normed_x(cfg, sh)
    first = _read_as_is(ffn_x, router[0], "router", MOE) if reads_x else Stored(router[0], "router", [MOE])
    ffn_x.input_of.append(MOE)
    out = [first, ffn_x, *_saved(router[1:], "router", MOE)]
    out += _saved(tensors["moe_dispatch"], "moe_dispatch", MOE)
    out += _experts(cfg, sh, tensors["experts"])
    if "shared_experts" in tensors:
        out += _shared_experts(cfg, sh, tensors["shared_experts"], ffn_x, reads_x)
    return out


def _experts(cfg: Config, sh: Shapes, experts: list[int]) -> list[Stored]:
    """The GEMMs' inputs and offsets in the MoE layer; the activation (a call of its own) keeps
    the inputs it reads when recomputed (not the [R] probabilities it is handed and ignores without
    the memory-efficient permutation) and frees its output h, which the down GEMM saves. Where the
    down GEMM keeps an FP8 copy of h instead (and its scales: precision.fp8_saved_activations), h
    is not recomputed (act.down_input): the copy is the GEMM's own."""
    rows, mem_efficient = act.expert_rows(cfg, sh), cfg.moe.memory_efficient_permute
    activation = act.activation_tensors(cfg, sh, rows)
    kept_h = len(act.down_input(cfg, act.experts_shapes(cfg, sh), rows))
    gemms, h = experts[:-len(activation) - kept_h], experts[-len(activation) - kept_h:len(experts) - len(activation)]
    inputs = len(activation) if mem_efficient else (2 if act.GATED[cfg.moe.activation] else 1)
    out = _saved(gemms, "experts", MOE)
    out += [Stored(h[0], "experts", [MOE], output_of=MOE_ACT)] if kept_h == 1 else _saved(h, "experts", MOE)
    out += [Stored(s, "experts", [MOE_ACT], held_by=[MOE_ACT]) for s in activation[:inputs]]
    out += _saved(activation[inputs:], "experts", MOE_ACT)  # silu(gate)
    return out


def _shared_experts(cfg: Config, sh: Shapes, shared: list[int], ffn_x: Stored,
                    router_reads_x: bool) -> list[Stored]:
    """Shared experts read the normed x (all-gathered under SP) as it is, unless each linear keeps
    its own cast (input copies); their recompute keeps it."""
    x = _gathered(cfg, sh, ffn_x)
    x.input_of.append(SHARED)
    if sh.input_copies:
        return [x, *_saved(shared, "shared_experts", SHARED)]
    if x is ffn_x and router_reads_x:  # listed with the router's storages
        return [x.saved(SHARED), *_saved(shared, "shared_experts", SHARED)]
    return [_read_as_is(x, shared[0], "shared_experts", SHARED), *_saved(shared[1:], "shared_experts", SHARED)]


def _dense_mlp(cfg: Config, sh: Shapes, tensors: act.Tensors, ffn_x: Stored) -> list[Stored]:
    x, mlp = _gathered(cfg, sh, ffn_x), tensors["mlp"]
    x.input_of.append(MLP)
    if sh.input_copies:
        return [x, *_saved(mlp, "mlp", MLP)]
    return [_read_as_is(x, mlp[0], "mlp", MLP), *_saved(mlp[1:], "mlp", MLP)]


def _weight_copies(cfg: Config, layer_id: int, sh: Shapes, moe_layer: bool) -> list[Stored]:
    """Parameter casts, by the call whose ops make and keep them (each weight's in one place)."""
    m = cfg.model
    parts = act.weight_copies_by_part(cfg, layer_id, sh)
    norm = act._cast(m.dim, FP32, sh)
    by_call = {ATTN_NORM: norm, FFN_NORM: norm}
    if m.attention == "mla":  # the up-projection's linears and the latent norms' weights
        linears, norms = _up_proj_weight_copies(cfg, act.block_shapes(cfg, layer_id, sh), sh)
        by_call.update({UP_PROJ: linears + norms, LAYER: parts["attn"] - linears})
    else:
        qk = act._cast(m.head_dim or m.dim // m.n_heads, FP32, sh) if m.qk_norm else 0
        by_call.update({Q_NORM: qk, K_NORM: qk, LAYER: parts["attn"]})
    if moe_layer:
        by_call.update({MOE: parts["router"] + parts["experts"], SHARED: parts["shared"]})
    else:
        by_call[MLP] = parts["mlp"]
    return [Stored(n, "weight_copies", [call], weight=True) for call, n in by_call.items() if n]


def _up_proj_weight_copies(cfg: Config, sh: Shapes, sh_params: Shapes) -> tuple[int, int]:
    """The casts MLA's up-projection makes: wq's (or wq_b's) and wkv_b's; the latent norms'
    fp32 weights."""
    m = cfg.model
    Q, C, H = m.q_lora_rank, m.kv_lora_rank, m.n_heads // sh.tp
    wq = (Q or m.dim) * H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    linears = act._cast(wq + C * H * (m.qk_nope_head_dim + m.v_head_dim), sh.act_bytes, sh_params)
    return linears, act._cast(C + Q, FP32, sh_params)
