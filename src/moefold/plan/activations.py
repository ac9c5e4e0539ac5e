"""Saved-activation bytes of one micro-batch, module by module, from the config alone.

Each formula lists what moefold's code keeps for backward, op by op, storage by storage (the
tensors autograd saves, each storage once, parameters excluded; `layer_tensors`: memory.offload
moves or leaves each by its size), for GPU kernels: attention is a fused kernel (FlashAttention-2
/ cuDNN) that keeps q, k, v, the output and an fp32 log-sum-exp. `plan.measure` runs the real model
under FakeTensorMode (or one rank of it under TP, for real) and counts the same thing, and tests
hold the two together category by category. Rules that recur:

- RMSNorm computes in fp32: it keeps the fp32 input, the normalised fp32 rows and one rsqrt per
  row (8·d + 4 bytes a row), whatever the compute dtype; its output is kept by the next linear.
- Linears keep their input (shared by the q/k/v projections, which read one tensor).
- The router runs in its dtype (fp32, or fp64) on a copy of its input in it, and keeps scores
  [T, E] in it; where the normed x is in the router's dtype already, that copy is the normed x.
- A parameter used in another dtype than its own is cast once per forward and the cast is kept
  (category `weight_copies`): under bf16 autocast over fp32 parameters every matmul weight
  (autocast's cast of a linear's weight, the experts' `w.to(bf16)`), with bf16 parameters the
  norm weights (cast to fp32) and the router's (to the router dtype).
- Under bf16 autocast over fp32 parameters the residual stream and the norm outputs are fp32, and
  each linear that reads a normed x keeps its own bf16 cast of it (autocast caches casts of leaf
  parameters only): q, k and v three copies, gated MLPs two.

Sizes are per rank: T tokens of the rank's micro-batch after context parallelism (B·S/cp); heads and
dense/shared hidden sizes divided by tp; the final norm and the output head run on all T tokens on
every TP rank, and so do MLA's down-projections and latent norms without sequence parallelism.
Under sequence parallelism (parallel.sequence_parallel with tp > 1, parallel/tensor.py) the main
blocks' residual stream and pre-norms hold this rank's T/tp tokens (`Shapes.residual_tokens`); the
GQA and dense-MLP linears after a pre-norm keep the all-gathered T tokens as they would keep the
norm's output, MLA's down-projections and latent norms run on the T/tp tokens and its
up-projections keep the all-gathered latents; the MTP modules and blocks are not
sequence-parallel. An MoE layer routes the residual stream's tokens (parallel/sequence.py): without
sequence parallelism the router runs on all T tokens of the TP group on every TP rank and each rank
dispatches its T/tp of them; with it the router, the balancing losses and the dispatch see only the
rank's own T/tp, and the shared experts all-gather the T tokens and reduce-scatter their output
back to the rank's rows. Either way a rank dispatches T/tp·K copies and its experts see R rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moefold.config import Config
from moefold.fp8.apply import excluded_by, linear_aligned
from moefold.fp8.gemm import linear_scaling
from moefold.fp8.grouped import grouped_scaling
from moefold.moe.capacity import padded_capacity
from moefold.moe.permute import RowLayout

CATEGORIES = ("embedding", "norm", "attn_proj", "attn_core", "mlp", "router", "moe_dispatch",
              "experts", "shared_experts", "mtp_proj", "head", "weight_copies", "kept_inputs")
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
    param_bytes: int = 0  # parameters as forward reads them (FSDP gathers them in their own dtype);
    # 0: the compute dtype's
    fp8_kept: str = ""  # the tile kind of the FP8 inputs this block keeps ("tensor", "row",
    # "1x128"; precision.fp8_saved_activations), else ""; set per block by block_shapes
    fp8_block: str = ""  # the block's module name ("layers.3", "mtp.layers.0.block") where
    # apply_fp8 converts its modules (FP8 on, not a first/last bf16 layer), else ""; block_shapes
    seq_split: int = 1  # how many ranks share the block's residual stream along the sequence: tp
    # in the main blocks under sequence parallelism, else 1; set per block by block_shapes

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def residual_tokens(self) -> int:
        """Tokens of the residual stream and the pre-norms on this rank, which are also the tokens
        an MoE layer routes: all T of the TP group without sequence parallelism, the rank's own
        T/tp with it (parallel/sequence.py's route_sequence_shard)."""
        return self.tokens // self.seq_split

    @property
    def fp32(self) -> bool:
        return self.act_bytes == 4

    @property
    def params(self) -> int:
        return self.param_bytes or self.act_bytes

    @property
    def input_copies(self) -> bool:
        """Autocast over fp32 parameters: each linear keeps its own cast of an fp32 normed x."""
        return self.params != self.act_bytes


Bytes = dict[str, int]
Tensors = dict[str, list[int]]  # by category, the bytes of each storage kept for backward


def norm_tensors(rows: int, dim: int) -> list[int]:
    """RMSNorm: fp32 input (a copy unless it is fp32), normalised fp32 rows, rsqrt per row."""
    return [rows * dim * FP32, rows * dim * FP32, rows * FP32]


def norm_bytes(rows: int, dim: int) -> int:
    return sum(norm_tensors(rows, dim))


def kept_input(rows: int, cols: int, sh: Shapes, fp8: bool = True) -> list[int]:
    """What a linear keeps of its [rows, cols] input: the input in the compute dtype, or, where
    inputs are kept in FP8 (fp8/saved.py) and this linear runs in FP8, 1 byte per element and the
    forward tiles' fp32 scales — one per row, per 128 columns of a row (1x128 tiles), or one for
    the tensor (two storages)."""
    if not (sh.fp8_kept and fp8):
        return [rows * cols * sh.act_bytes]
    scales = {"row": rows, "1x128": rows * (cols // 128), "tensor": 1}[sh.fp8_kept]
    return [rows * cols, scales * FP32]


def sibling_inputs(rows: int, cols: int, sh: Shapes, fp8: list[bool]) -> list[int]:
    """Siblings reading one input (q/k/v, gate and up; `fp8`: which run in FP8): with input copies
    each keeps its own, in FP8 where inputs are; otherwise one shared compute-dtype tensor
    (fp8/apply.py keeps a shared input as it is: FP8 copies would each cost half of it)."""
    if sh.input_copies:
        return [s for f in fp8 for s in kept_input(rows, cols, sh, f)]
    return [rows * cols * sh.act_bytes]


def fp8_module(cfg: Config, sh: Shapes, name: str) -> bool:
    """Whether apply_fp8 may convert the block's module `name` ("attn.wq", "ffn.experts"): the
    block runs FP8 and no `precision.fp8_exclude` pattern matches the module or a parent of it."""
    return bool(sh.fp8_block) and not excluded_by(cfg.precision.fp8_exclude, f"{sh.fp8_block}.{name}")


def fp8_linear(cfg: Config, sh: Shapes, name: str, in_features: int, out_features: int) -> bool:
    """Whether apply_fp8 converts the block's linear `name` of these (global) features: an FP8
    module (fp8_module) whose features on one TP rank (parallel/tp_split.py) are multiples of the
    recipe's alignment (16; 128 for blockwise)."""
    if not fp8_module(cfg, sh, name):
        return False
    multiple = linear_scaling(cfg.precision.fp8).row_multiple
    return linear_aligned(name.rpartition(".")[2], in_features, out_features, sh.tp, multiple)


def _add(into: Bytes, **parts: int) -> Bytes:
    for key, value in parts.items():
        into[key] = into.get(key, 0) + int(value)
    return into


def gqa_tensors(cfg: Config, sh: Shapes) -> Tensors:
    m, T = cfg.model, sh.tokens
    H, G = m.n_heads // sh.tp, (m.n_kv_heads or m.n_heads) // sh.tp
    Dh = m.head_dim or m.dim // m.n_heads
    # x (once per q, k, v projection with input copies); wo's input is a view of the core's output
    Hg, Gg = m.n_heads * Dh, (m.n_kv_heads or m.n_heads) * Dh
    qkv_fp8 = [fp8_linear(cfg, sh, "attn.wq", m.dim, Hg), fp8_linear(cfg, sh, "attn.wk", m.dim, Gg),
               fp8_linear(cfg, sh, "attn.wv", m.dim, Gg)]
    out = {"attn_proj": sibling_inputs(T, m.dim, sh, qkv_fp8)}
    if m.qk_norm:
        out["norm"] = norm_tensors(T * H, Dh) + norm_tensors(T * G, Dh)
    qkv, output, internal = core_tensors(cfg, sh)
    return {**out, "attn_core": [*qkv, output, *internal]}


def core_tensors(cfg: Config, sh: Shapes) -> tuple[list[int], int, list[int]]:
    """The fused attention kernel's saved storages: q, k and v; the output; the log-sum-exp and a
    sliding window's mask (a bias in q's dtype). MLA's q and k are concatenations (nope | rope)
    and its v a view of the kv up-projection, whose whole [.., Dn + Dv] output it keeps alive."""
    m, T, a, H = cfg.model, sh.tokens, sh.act_bytes, cfg.model.n_heads // sh.tp
    internal = [T * H * FP32]
    if m.attention == "mla":
        Dn, Dr, Dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qk = T * H * (Dn + Dr) * a
        return [qk, qk, T * H * (Dn + Dv) * a], T * H * Dv * a, internal  # the kv storage v views
    G, Dh = (m.n_kv_heads or m.n_heads) // sh.tp, m.head_dim or m.dim // m.n_heads
    if window_masked(cfg):
        internal.append(sh.seq * sh.seq * a)
    return [T * H * Dh * a, T * G * Dh * a, T * G * Dh * a], T * H * Dh * a, internal


def window_masked(cfg: Config) -> bool:
    """Whether attention reads a sliding window's [S, S] mask: a window shorter than the sequence
    (models/attention.py's SlidingWindowMask; a longer one is plain causal, masked in the kernel)."""
    return cfg.model.attention == "gqa" and 0 < cfg.model.sliding_window < cfg.train.seq_len


def mla_proj_inputs(cfg: Config, sh: Shapes) -> tuple[list[int], list[int], list[int]]:
    """MLA's attn_proj storages in three parts: wq_a's (or wq's) own input ([] where it reads
    wkv_a's, the normed x, as a sibling: no input copies), wkv_a's input, and wq_b's and wkv_b's
    (normed) inputs. The down-projections run on the residual stream's tokens (the rank's T/tp
    under sequence parallelism, parallel/tensor.py), the up-projections on all T (under sequence
    parallelism they keep the all-gathered latents, and wq without q-LoRA an all-gathered x)."""
    m, T, Tr = cfg.model, sh.tokens, sh.residual_tokens
    Q, C = m.q_lora_rank, m.kv_lora_rank
    Dn, Dr, Dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    Hq, Hkv = m.n_heads * (Dn + Dr), m.n_heads * (Dn + Dv)  # global output features
    wq_fp8 = fp8_linear(cfg, sh, "attn.wq_a" if Q else "attn.wq", m.dim, Q or Hq)
    wkv_a_fp8 = fp8_linear(cfg, sh, "attn.wkv_a", m.dim, C + Dr)
    if Q or Tr == T:  # wq(_a) and wkv_a read the normed x: sibling_inputs' rule
        own = sh.input_copies
        wkv_x = kept_input(Tr, m.dim, sh, own and wkv_a_fp8)
        wq_x = kept_input(Tr, m.dim, sh, wq_fp8) if own else []
    else:  # under SP wq gathers x itself, its own [T, D], and wkv_a alone keeps the rank's rows
        wkv_x = kept_input(Tr, m.dim, sh, wkv_a_fp8 and not wkv_a_input_freed(cfg, sh))
        wq_x = kept_input(T, m.dim, sh, wq_fp8)
    q_b = kept_input(T, Q, sh, fp8_linear(cfg, sh, "attn.wq_b", Q, Hq)) if Q else []
    kv_b = kept_input(T, C, sh, fp8_linear(cfg, sh, "attn.wkv_b", C, Hkv))
    return wq_x, wkv_x, q_b + kv_b


def wkv_a_input_freed(cfg: Config, sh: Shapes) -> bool:
    """Whether a recomputed pre-norm frees wkv_a's input, the normed x it reads as it is (no
    input copies): wkv_a then keeps it as it is, not in FP8 (fp8/apply.py; a copy would outlive
    the free)."""
    return "norm" in cfg.memory.recompute and not sh.input_copies


def mla_tensors(cfg: Config, sh: Shapes) -> Tensors:
    """MLA's storages: the projections' inputs (`mla_proj_inputs`), the latent norms', the core's."""
    m, Tr = cfg.model, sh.residual_tokens
    Q, C, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    wq_x, wkv_x, up_inputs = mla_proj_inputs(cfg, sh)
    out = {"attn_proj": wq_x + wkv_x + up_inputs}
    # In fp32 the latent norm keeps its input as it is: a view of wkv_a's [Tr, C + Dr] output.
    out["norm"] = norm_tensors(Tr, C) + (norm_tensors(Tr, Q) if Q else [])
    if sh.fp32:
        out["norm"][0] = Tr * (C + Dr) * FP32
    qkv, output, internal = core_tensors(cfg, sh)
    return {**out, "attn_core": [*qkv, output, *internal]}


def dense_mlp_tensors(cfg: Config, sh: Shapes) -> list[int]:
    T, a, H = sh.tokens, sh.act_bytes, cfg.model.ffn_hidden // sh.tp
    # x (w1 and w3 each cast it with input copies); gate, up, silu(gate) and w2's input h
    D, Hg = cfg.model.dim, cfg.model.ffn_hidden
    fp8_in = [fp8_linear(cfg, sh, f"ffn.{w}", D, Hg) for w in ("w1", "w3")]
    fp8_out = fp8_linear(cfg, sh, "ffn.w2", Hg, D)
    return sibling_inputs(T, D, sh, fp8_in) + [T * H * a] * 3 + kept_input(T, H, sh, fp8_out)


def expert_rows(cfg: Config, sh: Shapes) -> int:
    """R: rows one rank's experts compute. Balanced routing sends T/tp·K copies from every rank of
    the ep·etp group and spreads them over ep ranks; an etp group computes its rows together.
    Padded to capacity, every rank of the group sends each expert exactly C rows, whatever the
    routing, rounded up to the row multiple: C of the tokens the router dropped from, the rank's
    T/tp under sequence parallelism, else the TP group's T, one rank's half of which may hold all
    C copies of an expert (SequenceSplitDispatcher, RowLayout.of_slice). The all-gather dispatcher
    lays out all M = ep·etp·T/tp·K gathered copies (plus the padding), whatever the routing."""
    moe = cfg.moe
    multiple = row_multiple(cfg, sh)
    capacity_of = padded_capacity(moe)
    if capacity_of is not None:  # every rank of the group lays out E·C rows (the layer's RowLayout): etp·E·C
        layout = RowLayout(moe.num_experts, moe.top_k, multiple, capacity_of)
        return sh.etp * layout.num_rows(sh.residual_tokens * moe.top_k)
    if gathers_copies(cfg, sh):  # a static buffer of every copy the group gathered, whatever the routing
        return gathered_copies(cfg, sh) + moe.num_experts // sh.ep * (multiple - 1)
    copies = sh.tokens // sh.tp * moe.top_k * sh.etp
    return int(copies * sh.imbalance) + moe.num_experts // sh.ep * (multiple - 1)


def gathers_copies(cfg: Config, sh: Shapes) -> bool:
    """Whether the MoE layers dispatch by all-gather (parallel.ep_dispatcher, under ep·etp > 1;
    parallel/expert.py's AllGatherDispatcher): each rank gathers the whole group's tokens and lays
    out an expert buffer of all their copies, M rows, its own experts' first."""
    return cfg.parallel.ep_dispatcher == "allgather" and sh.ep * sh.etp > 1


def gathered_copies(cfg: Config, sh: Shapes) -> int:
    """M: the copies the all-gather dispatcher gathers, T/tp·K from each rank of the ep·etp group."""
    return sh.ep * sh.etp * (sh.tokens // sh.tp) * cfg.moe.top_k


def row_multiple(cfg: Config, sh: Shapes) -> int:
    """What each expert's group is padded to: moe.pad_multiple, raised to the FP8 grouped kernels'
    alignment in the MoE layers whose experts apply_fp8 converts (fp8/apply.py)."""
    multiple = max(1, cfg.moe.pad_multiple)
    if fp8_module(cfg, sh, "ffn.experts"):
        multiple = max(multiple, grouped_scaling(cfg.precision.fp8).row_multiple)
    return multiple


def router_tensors(cfg: Config, sh: Shapes) -> list[int]:
    """The router and its balancing losses on the tokens it routes (`Shapes.residual_tokens`)."""
    moe, D = cfg.moe, cfg.model.dim
    T, K, E, r = sh.residual_tokens, moe.top_k, moe.num_experts, ROUTER_BYTES[moe.router_dtype]
    out = [T * D * r, T * E * r, T * K * INT64]  # fp32 input, scores, chosen ids
    if moe.input_jitter:
        out.append(T * D * r)  # the noise
    mixtral_style = moe.score_func == "softmax" and not moe.softmax_before_topk
    if mixtral_style:
        out.append(T * E * r)  # gather keeps the logits it picks from
    if moe.norm_topk_prob or mixtral_style:
        out.append(T * K * r)  # the chosen probabilities, kept by the renormalising division
    if moe.norm_topk_prob:
        out.append(T * r)
    # Group-limited selection keeps nothing: only its indices are used, which carry no gradient.
    return out + _balance_tensors(cfg, sh, T)


def router_reads_normed_x(cfg: Config, sh: Shapes) -> bool:
    """Whether the router's input is the normed x itself, not a cast of it: the router dtype is the
    residual stream's (fp32 compute, or fp32 parameters under autocast, with an fp32 router)."""
    return ROUTER_BYTES[cfg.moe.router_dtype] == sh.params


def _balance_tensors(cfg: Config, sh: Shapes, T: int) -> list[int]:
    """The balancing losses over the router's T tokens of B sequences (under sequence parallelism
    a shard of each, whose counts are summed over the TP group in tensors of the same sizes,
    moe/balance.py)."""
    moe, E, B = cfg.moe, cfg.moe.num_experts, sh.batch
    out = []
    if moe.score_func == "sigmoid" and (moe.aux_loss_coeff or moe.seq_aux_loss_coeff
                                        or moe.global_aux_loss_coeff):
        # the per-token sum that normalises sigmoid scores for balancing, in the scores' dtype
        out.append(T * ROUTER_BYTES[moe.router_dtype])
    if moe.aux_loss_coeff:
        out += [T, INT64, E * FP32]
    if moe.seq_aux_loss_coeff:
        out += [T, B * INT64, B * E * FP32, INT64]
    if moe.global_aux_loss_coeff:
        out += [T, E * FP32, INT64]
    if moe.z_loss_coeff:
        out += [T * E * FP32, T * FP32, T, INT64]
    return out


def _has_aux_loss(cfg: Config) -> bool:
    moe = cfg.moe
    return bool(moe.aux_loss_coeff or moe.seq_aux_loss_coeff or moe.global_aux_loss_coeff
                or moe.z_loss_coeff)


def dispatch_tensors(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    """Permutation indices and masks of this rank's N = T/tp·K copies; without the memory-efficient
    permutation also the [N, D] expert outputs and [N] probabilities of the weighted combine."""
    if gathers_copies(cfg, sh):  # the all-gather dispatcher's maps are over the M gathered copies
        return _gathered_dispatch_tensors(cfg, sh, rows)
    moe, a = cfg.moe, sh.act_bytes
    N, routed = sh.tokens // sh.tp * moe.top_k, sh.residual_tokens * moe.top_k
    if sh.ep * sh.etp > 1 and padded_capacity(moe) is None:  # the all-to-all dispatcher's own maps
        out = _all_to_all_maps(cfg, sh, N, rows)
    else:
        # The gathers' backward maps (moe/permute.py): each copy's row and keep mask (permute), each
        # row's copy and valid mask (unpermute, [R] of R + 1; the probabilities' gather shares that
        # index). The keep mask is the router's tokens' [T·K]: without sequence parallelism a TP
        # rank's copies are a view of the TP group's (parallel/sequence.py), with it the rank's own.
        out = [N * INT64, routed, rows * INT64, rows + 1]
    if _has_aux_loss(cfg):
        out.append(FP32)  # the summed aux loss, kept by the autograd function that injects it
    if moe.memory_efficient_permute:
        return out
    # The weighted combine keeps the expert outputs and the probabilities in the compute dtype: in
    # fp32 (and an fp32 router) the probabilities themselves, a view of the router's [T, K].
    probs = routed * FP32 if sh.fp32 and ROUTER_BYTES[moe.router_dtype] == FP32 else N * a
    return out + [N * cfg.model.dim * a, probs]


def _all_to_all_maps(cfg: Config, sh: Shapes, N: int, rows: int) -> list[int]:
    """The all-to-all dispatcher's maps (parallel/expert.py's AllToAllDispatcher; padded to
    capacity it permutes locally, as above): each copy's place in the sorted order, and the order
    the probabilities are gathered by (memory-efficient permutation); combine's [S + 1] rows and
    mask of the S = N rows sent; the R received rows' regrouping both ways (SortedRegroup) or,
    padded to the row multiple (PaddedRegroup), their [R + 1] rows and mask, the [Y] groups' index
    both ways (the probabilities' one with the memory-efficient permutation) and valid mask."""
    moe, multiple = cfg.moe, row_multiple(cfg, sh)
    received = rows - moe.num_experts // sh.ep * (multiple - 1)
    out = [N * INT64] * (1 + moe.memory_efficient_permute) + [(N + 1) * INT64, N + 1]
    if multiple == 1:
        return out + [received * INT64] * 2
    return (out + [(received + 1) * INT64, received + 1, rows * INT64, rows + 1]
            + [rows * INT64] * moe.memory_efficient_permute)


def _gathered_dispatch_tensors(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    """The all-gather dispatcher's (parallel/expert.py) over the M gathered copies. Unpadded
    (SortedBuffer): the buffer's gather index and row-valid mask, the probabilities' index (with the
    memory-efficient permutation), each copy's row and local mask (combine). Padded (PaddedBuffer):
    the local permutation's maps of M copies into the rows. Without the memory-efficient
    permutation the weighted combine keeps the [M, D] copies' outputs and [M] probabilities."""
    moe, M = cfg.moe, gathered_copies(cfg, sh)
    if row_multiple(cfg, sh) > 1:
        out = [M * INT64, M, rows * INT64, rows + 1]
    else:
        out = [M * INT64, M] + [M * INT64] * moe.memory_efficient_permute + [M * INT64, M]
    if _has_aux_loss(cfg):
        out.append(FP32)
    if moe.memory_efficient_permute:
        return out
    return out + [M * cfg.model.dim * sh.act_bytes, M * sh.act_bytes]


def experts_shapes(cfg: Config, sh: Shapes) -> Shapes:
    """The block's shapes as its routed experts keep their inputs."""
    if not fp8_module(cfg, sh, "ffn.experts"):
        return replace(sh, fp8_kept="")  # excluded: the experts keep their inputs as they are
    if sh.fp8_kept:  # the experts' own tiles (a tensorwise run's experts scale rows: fp8/grouped.py)
        return replace(sh, fp8_kept=grouped_scaling(cfg.precision.fp8).forward.a.tile)
    return sh


def experts_tensors(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    moe, D = cfg.moe, cfg.model.dim
    sh = experts_shapes(cfg, sh)
    # The input rows (once: in FP8 gate and up keep one copy, fp8/grouped.py's fp8_grouped_mms),
    # int32 offsets, and the activation's output h, which the down GEMM keeps.
    out = kept_input(rows, D, sh) + [moe.num_experts // sh.ep * 4] + down_input(cfg, sh, rows)
    return out + activation_tensors(cfg, sh, rows)


def down_input(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    """What the down GEMM keeps of the activation's output h: as it is where moe_act is
    recomputed (the recompute frees it; fp8/apply.py keeps no FP8 copy, which would outlive it),
    else as the experts keep their inputs (`sh`: experts_shapes')."""
    if "moe_act" in cfg.memory.recompute:
        sh = replace(sh, fp8_kept="")
    return kept_input(rows, cfg.moe.expert_hidden // sh.etp, sh)


def activation_tensors(cfg: Config, sh: Shapes, rows: int) -> list[int]:
    """What the experts' activation (moe/activation.py) saves of its [R, F] inputs: gate and up
    (and the [R] probabilities it folds in) with the memory-efficient permutation, else its
    input(s) and silu(gate)."""
    F, gated = cfg.moe.expert_hidden // sh.etp, GATED[cfg.moe.activation]
    if cfg.moe.memory_efficient_permute:
        return [rows * F * sh.act_bytes] * (2 if gated else 1) + [rows * FP32]
    return [rows * F * sh.act_bytes] * (3 if gated else 1)


def shared_tensors(cfg: Config, sh: Shapes) -> list[int]:
    """Shared experts, TP-sharded like a dense MLP, on all T tokens of the TP group: under sequence
    parallelism they all-gather the rank's T/tp (one [T, D] tensor w1, w3 and the gate read) and
    reduce-scatter w2's output back to its rows (parallel/sequence.py)."""
    moe, T, a, D = cfg.moe, sh.tokens, sh.act_bytes, cfg.model.dim
    F = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden) // sh.tp
    gated = GATED[moe.activation]
    Fg = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden)  # global
    fp8_in = [fp8_linear(cfg, sh, f"ffn.shared.{w}", D, Fg) for w in (("w1", "w3") if gated else ("w1",))]
    fp8_out = fp8_linear(cfg, sh, "ffn.shared.w2", Fg, D)
    # With input copies each of w1, w3 (and the gate) keeps its own bf16 cast of the normed x.
    # Otherwise they read it as it is, which the router keeps already where it reads it too (not
    # under sequence parallelism: they read the all-gathered copy).
    if sh.input_copies:
        inputs = [s for f in fp8_in for s in kept_input(T, D, sh, f)] + [T * D * a] * moe.shared_expert_gate
    else:
        inputs = [] if router_reads_normed_x(cfg, sh) and sh.seq_split == 1 else [T * D * a]
    # gate, up, silu(gate) (or the activation's input), w2's input h
    out = inputs + [T * F * a] * (3 if gated else 1) + kept_input(T, F, sh, fp8_out)
    if moe.shared_expert_gate:
        # The gate's product keeps the experts' output (the rank's rows of it under sequence
        # parallelism, w2's reduce-scatter) and the gate [T, 1] (replicated: all T rows).
        out += [sh.residual_tokens * D * a, T * a]
    return out


def moe_tensors(cfg: Config, sh: Shapes) -> Tensors:
    rows = expert_rows(cfg, sh)
    out = {"router": router_tensors(cfg, sh), "moe_dispatch": dispatch_tensors(cfg, sh, rows),
           "experts": experts_tensors(cfg, sh, rows)}
    if cfg.moe.shared_experts:
        out["shared_experts"] = shared_tensors(cfg, sh)
    return out


def _norm_weights(cfg: Config) -> int:
    """Elements of one block's norm weights (pre-norms, QK-norms, MLA's latent norms)."""
    m = cfg.model
    if m.attention == "mla":
        return 2 * m.dim + m.kv_lora_rank + m.q_lora_rank
    return 2 * m.dim + (2 * (m.head_dim or m.dim // m.n_heads) if m.qk_norm else 0)


def _cast(elements: float, used_bytes: int, sh: Shapes) -> int:
    """Bytes of a parameter's cast to the dtype an op uses it in (none in its own dtype)."""
    return int(elements * used_bytes) if used_bytes != sh.params else 0


def weight_copies_by_part(cfg: Config, layer_id: int, sh: Shapes) -> Bytes:
    """The casts of one block's parameters kept for backward, by the part that makes them
    ("norms", "attn", "router", "experts", "shared", "mlp"): matmul weights in the compute dtype,
    norm weights in fp32, the router's in the router dtype (each only where it differs)."""
    from moefold.models.transformer import is_moe_layer
    from moefold.plan.params import attention_params, ffn_params

    moe, a, D = cfg.moe, sh.act_bytes, cfg.model.dim
    attn = attention_params(cfg)
    norms = _norm_weights(cfg)
    out = {"norms": _cast(norms, FP32, sh),
           "attn": _cast(attn.tp / sh.tp + attn.replicated - (norms - 2 * D), a, sh)}
    if not is_moe_layer(cfg, layer_id):
        return _add(out, mlp=_cast(ffn_params(cfg, layer_id).tp / sh.tp, a, sh))
    ffn = ffn_params(cfg, layer_id)
    router = moe.num_experts * D
    # precision.fp8_weight_cache: the FP8 experts' backward keeps the cached FP8 w^T, not the cast w.
    return _add(out, router=_cast(router, ROUTER_BYTES[moe.router_dtype], sh),
                experts=0 if cached_fp8_experts(cfg, layer_id, sh) else _cast(ffn.expert / (sh.ep * sh.etp), a, sh),
                shared=_cast(ffn.tp / sh.tp + ffn.replicated - router, a, sh))


def cached_fp8_experts(cfg: Config, layer_id: int, sh: Shapes) -> bool:
    """Whether precision.fp8_weight_cache holds this block's routed experts' FP8 weights: the
    option is on and apply_fp8 converts the experts (fp8_module)."""
    return cfg.precision.fp8_weight_cache and fp8_module(cfg, block_shapes(cfg, layer_id, sh), "ffn.experts")


def weight_copy_bytes(cfg: Config, layer_id: int, sh: Shapes) -> int:
    return sum(weight_copies_by_part(cfg, layer_id, sh).values())


def block_shapes(cfg: Config, layer_id: int, sh: Shapes) -> Shapes:
    """The shapes a block's activations follow: an MTP block's input is the projection's output,
    in the compute dtype, so its residual stream is too (no input copies); FP8 in the blocks
    apply_fp8 converts (all but the first/last `fp8_bf16_*_layers` of the main stack; within them
    `fp8_exclude` is matched module by module, fp8_module), with FP8-kept inputs where asked; the
    main blocks' residual stream split over TP under sequence parallelism (not the MTP blocks')."""
    p, n = cfg.precision, cfg.model.n_layers
    fp8_block = p.fp8 != "off" and (layer_id >= n or p.fp8_bf16_first_layers <= layer_id < n - p.fp8_bf16_last_layers)
    kept = linear_scaling(p.fp8).forward.a.tile if fp8_block and p.fp8_saved_activations else ""
    name = f"layers.{layer_id}" if layer_id < n else f"mtp.layers.{layer_id - n}.block"
    split = sh.tp if cfg.parallel.sequence_parallel and layer_id < n else 1
    sh = replace(sh, fp8_kept=kept, fp8_block=name if fp8_block else "", seq_split=split)
    return replace(sh, param_bytes=0) if layer_id >= n else sh


def layer_tensors(cfg: Config, layer_id: int, sh: Shapes) -> Tensors:
    """The storages one transformer block keeps, by category, but for its weight copies (layer
    ids count on through the MTP blocks)."""
    from moefold.models.transformer import is_moe_layer

    sh = block_shapes(cfg, layer_id, sh)
    out = mla_tensors(cfg, sh) if cfg.model.attention == "mla" else gqa_tensors(cfg, sh)
    out["norm"] = norm_tensors(sh.residual_tokens, cfg.model.dim) * 2 + out.get("norm", [])
    if is_moe_layer(cfg, layer_id):
        return {**out, **moe_tensors(cfg, sh)}
    return {**out, "mlp": dense_mlp_tensors(cfg, sh)}


def layer_bytes(cfg: Config, layer_id: int, sh: Shapes) -> Bytes:
    """One transformer block (layer ids count on through the MTP blocks)."""
    out = {category: sum(sizes) for category, sizes in layer_tensors(cfg, layer_id, sh).items()}
    copies = weight_copy_bytes(cfg, layer_id, sh)
    return _add(out, weight_copies=copies) if copies else out


def rope_table_bytes(cfg: Config, sh: Shapes) -> int:
    m = cfg.model
    rope_dim = m.qk_rope_head_dim if m.attention == "mla" else (m.head_dim or m.dim // m.n_heads)
    return 2 * sh.seq * rope_dim * FP32  # cos and sin, shared by every layer of a stage


def first_stage_bytes(cfg: Config, sh: Shapes) -> Bytes:
    return {"embedding": sh.tokens * INT64}


def last_stage_bytes(cfg: Config, sh: Shapes, vocab: int) -> Bytes:
    """Final norm, every head with its loss (the trunk's and each MTP depth's, plan.head), and
    each MTP module without its block (counted as a layer)."""
    from moefold.plan.head import head_losses

    T, D, mtp = sh.tokens, cfg.model.dim, cfg.model.mtp_layers
    heads = head_losses(cfg, sh, vocab)
    out = {"norm": norm_bytes(T, D), "head": sum(head.saved() for head in heads)}
    # With an fp32 residual stream hnorm's input is the hidden state the previous norm (final or
    # MTP) already keeps.
    hnorm_shared = T * D * FP32 if sh.params == FP32 else 0
    for _ in range(mtp):
        _add(out, embedding=T * INT64, norm=3 * norm_bytes(T, D) - hnorm_shared,
             mtp_proj=T * 2 * D * sh.act_bytes)
    # The head's weight (the embedding's when tied) is cast once where the heads keep its cast:
    # autocast caches leaf casts.
    head_cast = vocab * D if heads[0].keeps_weight_cast else 0
    copies = (_cast(head_cast + mtp * 2 * D * D, sh.act_bytes, sh)
              + _cast((1 + 3 * mtp) * D, FP32, sh))
    return _add(out, weight_copies=copies) if copies else out


def model_bytes(cfg: Config, sh: Shapes, vocab: int) -> Bytes:
    """The whole model on one pipeline stage (every layer, MTP included), by category."""
    out = _add({}, attn_core=rope_table_bytes(cfg, sh))
    for layer_id in range(cfg.model.n_layers + cfg.model.mtp_layers):
        _add(out, **layer_bytes(cfg, layer_id, sh))
    _add(out, **first_stage_bytes(cfg, sh))
    return _add(out, **last_stage_bytes(cfg, sh, vocab))
