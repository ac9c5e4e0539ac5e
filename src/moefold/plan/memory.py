"""Per-GPU memory of a training job, predicted from the config and the parallel layout without
allocating anything: `predict_memory(cfg, world_size) -> MemoryPlan`, `moefold plan memory`.

What one GPU holds, and the assumptions behind each part (docs/memory.md explains them):

- **Parameters, gradients, optimizer states.** Attention, dense-MLP and shared-expert weights are
  divided by tp; norms, MLA down-projections, routers, embedding and head are replicated over TP (as
  moefold's TP leaves them); routed experts are divided by ep·etp; a rank holds only its pipeline
  stage's layers. The compute dtype is bf16 unless `precision.compute_dtype = "fp32"` (auto means
  bf16: the plan is for a GPU). Bytes per parameter:
  - `fsdp`: the sharded parameter is the master (fp32 4, bf16 or bf16+remainder 2; FSDP2 all-gathers
    compute-dtype copies per block), gradients in the master's dtype, moments and the int16
    remainder (2) all sharded over dp·cp (dense) or edp (experts). A sharded state counts as the
    first data rank holds it, the busiest: ceil(rows / ranks) of a dim 0 the ranks do not divide
    (torch.chunk's cut, FSDP2's and ZeRO-1's alike: `params.busiest_elements`), not the mean.
  - `ddp`: ZeRO-1 (parallel/zero.py): parameters (the master's dtype, as forward reads them) and,
    until they are reduce-scattered, gradients replicated; the remainder and the moments sharded
    over dp·cp / edp. The optimizer's shard of a parameter is a view of it (no copy) where a dim
    splits evenly over the data ranks, as real model dims do; other shards are copies, not counted.
  - moments: fp32 4, bf16 2, fp8 1 + one fp32 scale per block of 128 along a row, counted tensor by
    tensor (a short row's block and a split that cuts blocks cost whole scales: `_scale_blocks`).
  - `precision.fp8_weight_cache`: both FP8 layouts of every local FP8 expert weight, 2 bytes per
    element, held for the whole run (fp8/weight_cache.py).
- **Activations** (`plan.activations`): saved-for-backward bytes of one micro-batch per model chunk,
  times the micro-batches in flight on the rank under Megatron-Core's 1F1B / interleaved schedule
  (`plan.pipeline`). Routing is assumed balanced; `imbalance` scales the busiest rank's rows.
  Under bf16 autocast over fp32 parameters they include the bf16 weight casts kept for backward.
- **Transients**: at the loss, on the rank with the head (`plan.head`), the logits and their fp32
  copy (forward) or the fp32 gradients of the log-probabilities and the logits (backward); with
  train.loss_chunk_tokens, the eager chunk step's logits and elementwise passes over one chunk
  (forward) or the scaled dh and dW (backward); in backward one layer's working set, taken as its
  saved activations less the experts' [R, F] tensors.
- **Communication buffers**: the all-to-all send and receive buffers of one MoE layer (ep·etp > 1:
  each copy once per ETP rank out, the busiest rank's rows in, padded to capacity E·C rows each way;
  with parallel.ep_dispatcher = "allgather" the combine's [M, D] gathered copies' outputs and their
  fp32 [ep·etp·T/tp, D] sums),
  FSDP2's all-gathered parameters (in their own dtype, dim 0 padded to a multiple of the ranks) of
  two blocks (the current and the prefetched one; or a block, its experts' flat buffer and
  FSDP2's copy of those it cuts on dim 1; or the root's flat buffer), the root's embedding and
  head (kept gathered from forward to backward), in backward
  FSDP2's reduce-scatter: a block's unsharded gradients (the master's dtype) and their send buffer
  (the reduce dtype, dim 0 padded to a multiple of the ranks; a group over one rank too) and the
  head's unsharded gradients (their shards come after backward), or the root's last
  reduce-scatter (`_reduce_scatter_moments`; none in a one-process job, which runs without FSDP),
  the pipeline's send/receive of one micro-batch.
- **Time order** (`_phases`): the peak is the largest of three moments. Forward ends with every
  in-flight activation held and the loss workspace, and no gradients yet unless micro-batches
  accumulate (or a pipeline interleaves them); or it peaks inside a recomputed or offloaded layer,
  which makes the plain layer's tensors before it lets them go. Backward walks the layers in reverse: at layer i the
  activations of the layers below it are still held, its own plus a working set, and the gradients
  of the layers from i up (and the head's) exist. The optimizer step holds every gradient and
  the workspace of PrecisionAwareAdamW's foreach path with fp8 moments (`_optimizer_step`: the
  pieces that cut their 128-element blocks, their fp32 copies and padded blocks), and no
  activations. Under
  ddp the step has three moments: the reduce-scatter (every full gradient and one bucket's flat
  buffers), the update (the gradient shards and the optimizer's workspace) and the all-gather (the
  gradient shards and one bucket's buffers).
Not modelled: the CUDA context, NCCL's own buffers and allocator fragmentation (a few GiB).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from moefold.config import Config, micro_batches_per_step, moe_layers_in
from moefold.data.tokenizer import model_vocab_size
from moefold.errors import ConfigError
from moefold.moe.capacity import padded_capacity
from moefold.optim.blocks import pieces_hold_whole_blocks
from moefold.parallel.dims import ParallelDims
from moefold.plan import activations as act
from moefold.plan import options
from moefold.plan.layers import Run, layer_runs
from moefold.plan.head import head_losses
from moefold.plan.params import (
    ParamSplit,
    Weight,
    block_weights,
    busiest_elements,
    busiest_rows,
    embedding_params,
    embedding_weights,
    head_params,
    head_weights,
    layer_params,
    local_scale_blocks,
    local_shape,
)
from moefold.plan.pipeline import (
    Chunk,
    LayerIds,
    model_chunks,
    peak_in_flight,
    rank_chunks,
    schedule_micro_batches,
)
from moefold.plan.refuse import refuse_unbuildable

GIB = 1024 ** 3
# Per element, an fp8 moment's fp32 scales at their fewest, one per 128 (plan/fit.py's floor); the
# plan counts the blocks themselves (`_scale_blocks`): a row's last block is whole however short.
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
MASTER_BYTES = {"fp32": 4, "bf16": 2, "bf16+remainder": 2}


@dataclass
class MemoryPlan:
    """Predicted bytes on the busiest GPU (the pipeline rank with the highest peak)."""
    world_size: int
    pp_rank: int
    layers: LayerIds  # layer ids on this rank (MTP blocks numbered on from n_layers)
    parameters: float
    gradients: float
    master_weights: float
    optimizer_moments: float
    activations: dict[str, float]  # by category (plan.activations.CATEGORIES), all in-flight
    in_flight: tuple[int, ...]  # micro-batches live per local chunk at the peak
    transient: float  # the largest working set: the loss's (forward or backward) or a layer's (in
    # backward, or in forward where memory.recompute / memory.offload wrap it)
    comm_buffers: dict[str, float]
    optimizer_step: float  # the optimizer's workspace
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # "forward" / "backward" / "optimizer step": what is held at that phase's peak, by part
    offloaded: float = 0.0  # host memory memory.offload's copies hold as forward ends, their most
    # (backward only releases them): one per storage a site call saved, those that also stay on the
    # GPU included
    fp8_weight_cache: float = 0.0  # precision.fp8_weight_cache: the experts' FP8 weights, both layouts
    rank_peaks: list[float] = field(default_factory=list)  # every pipeline rank's peak
    notes: list[str] = field(default_factory=list)

    @property
    def activation_total(self) -> float:
        return sum(self.activations.values())

    def phase_peak(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    @property
    def peak(self) -> float:
        return max(self.phase_peak(p) for p in self.phases)

    def fits(self, capacity_bytes: float) -> bool:
        return self.peak <= capacity_bytes


@dataclass(frozen=True)
class _Layout:
    dims: ParallelDims
    dense_shard: int  # ranks sharing one dense parameter's optimizer state (dp·cp)
    expert_shard: int  # ... one expert parameter's (edp)
    fsdp: bool

    @property
    def fsdp2(self) -> bool:
        """Whether FSDP2 wraps the model: a one-process job runs without it (parallel/launch.py:
        no layout), where a multi-process one wraps every group, one over a single rank included."""
        return self.fsdp and self.dims.world > 1


def _layout(cfg: Config, world_size: int) -> _Layout:
    p, m = cfg.parallel, cfg.model
    dims = ParallelDims(world_size, p.tp, p.cp, p.pp, p.ep, p.etp, p.order)
    dims.validate(num_experts=cfg.moe.num_experts, n_heads=m.n_heads,
                  n_kv_heads=m.n_kv_heads if m.attention == "gqa" else 0, n_layers=m.n_layers,
                  seq_len=cfg.train.seq_len, expert_hidden=cfg.moe.expert_hidden)
    return _Layout(dims, dims.dp * dims.cp, dims.edp, p.data_parallel == "fsdp")


def compute_bytes(cfg: Config) -> int:
    return 4 if cfg.precision.compute_dtype == "fp32" else 2


def _local(split: ParamSplit, dims: ParallelDims) -> tuple[float, float]:
    """(dense, expert) elements of `split` on one rank."""
    return split.tp / dims.tp + split.replicated, split.expert / (dims.ep * dims.etp)


def _states(cfg: Config, lay: _Layout, dense: float, expert: float, sharded: float,
            scales: float = 0.0) -> dict[str, float]:
    """Bytes of this rank's parameters, gradients, remainders and moments, from its (`dense`,
    `expert`) elements (`_local`), the elements of its share of the sharded states
    (`_busiest_shards`) and its fp32 scales of one fp8 moment (`_scale_blocks`)."""
    o = cfg.optim
    master = MASTER_BYTES[o.master_dtype]
    remainder = 2 if o.master_dtype == "bf16+remainder" else 0
    moments = (ELEMENT_BYTES[o.exp_avg_dtype] + ELEMENT_BYTES[o.exp_avg_sq_dtype]) * sharded \
        + 4 * scales * [o.exp_avg_dtype, o.exp_avg_sq_dtype].count("fp8")
    if lay.fsdp:
        return {"parameters": master * sharded, "gradients": master * sharded,
                "master_weights": remainder * sharded, "optimizer_moments": moments}
    return {"parameters": master * (dense + expert), "gradients": master * (dense + expert),
            "master_weights": remainder * sharded, "optimizer_moments": moments}


def _data_ranks(lay: _Layout, w: Weight) -> int:
    """The data ranks that shard `w`'s states: dp·cp for a dense weight, edp for an expert's."""
    return lay.expert_shard if w.expert else lay.dense_shard


def _busiest_shards(cfg: Config, lay: _Layout, chunks: list[Chunk], vocab: int) -> float:
    """Elements of this rank's share of its chunks' sharded states, where it is the first of its
    data ranks: torch.chunk gives that rank ceil(rows / ranks) of a dim 0 the ranks do not divide
    (`busiest_elements`), more than their mean share."""
    return _sum_over_weights(cfg, chunks, vocab, lambda w: busiest_elements(
        w, lay.dims, _data_ranks(lay, w), not lay.fsdp))


def _scale_blocks(cfg: Config, lay: _Layout, chunks: list[Chunk], vocab: int) -> float:
    """fp32 scales this rank keeps per fp8 moment of its chunks' parameters, the busiest data
    rank's (`local_scale_blocks`)."""
    return _sum_over_weights(cfg, chunks, vocab, lambda w: local_scale_blocks(
        w, lay.dims, _data_ranks(lay, w), not lay.fsdp))


def _sum_over_weights(cfg: Config, chunks: list[Chunk], vocab: int, of_weight) -> float:
    """The sum of `of_weight(w)` over the parameters of `chunks`, tensor by tensor."""
    def over(weights: list[Weight]) -> float:
        return sum(of_weight(w) for w in weights)

    per_block = {moe_layer: over(block_weights(cfg, moe_layer)) for moe_layer in (False, True)}
    total = 0.0
    for ch in chunks:
        n_moe = moe_layers_in(cfg, ch.layers)
        total += n_moe * per_block[True] + (len(ch.layers) - n_moe) * per_block[False]
        total += over(embedding_weights(cfg, vocab)) if ch.first else 0
        total += over(head_weights(cfg, vocab)) if ch.last else 0
    return total


def _gradients(cfg: Config, lay: _Layout, split: ParamSplit) -> float:
    """The bytes of `split`'s gradients on one rank without FSDP2 (ddp, one process): whole until
    reduce-scattered. FSDP2's are `_block_gradients`' and the reduce-scatters'."""
    assert not lay.fsdp2
    return MASTER_BYTES[cfg.optim.master_dtype] * sum(_local(split, lay.dims))


def _after_backward(cfg: Config, lay: _Layout, dense: float, expert: float, sharded: float, grads: float,
                    optimizer: float) -> list[dict[str, float]]:
    """What the optimizer step holds besides parameters and optimizer states, at each of its
    moments. FSDP: every (sharded) gradient and the optimizer's workspace. ddp (ZeRO-1): the
    reduce-scatter, the update and the all-gather, each bucket's flat buffers (all segments and
    this rank's) of at most zero.BUCKET_ELEMENTS elements; `sharded`: this rank's elements of the
    sharded states (`_busiest_shards`), its gradient shards'."""
    if lay.fsdp:
        return [{"gradients": grads, "transient": optimizer}]
    from moefold.parallel.zero import BUCKET_ELEMENTS

    master, reduced = MASTER_BYTES[cfg.optim.master_dtype], _reduce_bytes(cfg)
    bucket = max(min(BUCKET_ELEMENTS, n) * (1 + 1 / w)
                 for n, w in ((dense, lay.dense_shard), (expert, lay.expert_shard)))
    grad_shards = master * sharded
    return [{"gradients": grads, "communication": reduced * bucket},
            {"gradients": grad_shards, "transient": optimizer},
            {"gradients": grad_shards, "communication": master * bucket}]


@dataclass
class _CutPieces:
    """A foreach chunk's pieces that cut their fp8 blocks, summed: `elements` (N), their rows'
    padded `blocks` of BLOCK elements (the local blocks the pieces touch, B; P = B·BLOCK) and the
    `scales` of their whole rows (one per global block, F), and the piece elements
    (optim/precision.py's `_piece_elements`) that its chunking counts."""
    elements: float = 0
    blocks: float = 0
    scales: float = 0
    piece_elements: float = 0

    def add(self, rows: int, cols: int, total_cols: int) -> None:
        """A piece of `rows` rows of `cols` columns (from column 0) of rows `total_cols` wide."""
        from moefold.optim.blocks import BLOCK

        self.elements += rows * cols
        self.blocks += rows * -(-cols // BLOCK)  # rank 0's columns start a block
        self.scales += rows * -(-total_cols // BLOCK)
        self.piece_elements += rows * cols  # rank 0's piece is the largest of the ranks'

    def chunk(self, max_elements: int) -> _CutPieces:
        """The largest chunk's share: `_chunks` cuts a group every `max_elements` piece elements (a
        larger piece alone); beyond one chunk, a proportional share of at most that many."""
        if self.piece_elements <= max_elements:
            return self
        f = max_elements / self.piece_elements
        return _CutPieces(self.elements * f, self.blocks * f, self.scales * f, max_elements)


def _optimizer_step(cfg: Config, lay: _Layout, chunks: list[Chunk], vocab: int) -> float:
    """PrecisionAwareAdamW's workspace on rank 0 (tp, ep and data coordinates 0), the most its
    foreach path allocates at once. The GPU takes that path only for fp8 moments of pieces whose
    last dimension is cut inside a 128-element block (optim/precision.py `step`; optim/blocks.py):
    TP's row-parallel weights and ETP's w1/w3 whose width over the ranks is no multiple of 128, 1-D
    weights and ZeRO-1's column shards cut so by the data ranks. Torch's fused AdamW and the
    Triton update (optim/fused.py) make none. Each param group (`optim.adamw.param_groups`: with
    and without weight decay) runs in chunks of FOREACH_ELEMENTS; the largest chunk counts
    (`_foreach_peak`)."""
    from moefold.optim.precision import FOREACH_ELEMENTS

    o = cfg.optim
    if "fp8" not in (o.exp_avg_dtype, o.exp_avg_sq_dtype):
        return 0.0
    groups = {True: _CutPieces(), False: _CutPieces()}  # weight decay: matrices but the embedding
    for ch in chunks:
        for w, decay in _chunk_weights(cfg, ch, vocab):
            _add_cut_piece(groups[decay], w, lay)
    return max(_foreach_peak(cfg, g.chunk(FOREACH_ELEMENTS)) for g in groups.values())


def _chunk_weights(cfg: Config, ch: Chunk, vocab: int) -> list[tuple[Weight, bool]]:
    """(weight, in the weight-decay group) of every parameter of `ch`."""
    from moefold.models.transformer import is_moe_layer

    out = [w for layer in ch.layers for w in block_weights(cfg, is_moe_layer(cfg, layer))]
    out += head_weights(cfg, vocab) if ch.last else []
    decayed = [(w, not w.vector) for w in out]
    return decayed + [(w, False) for w in embedding_weights(cfg, vocab)] if ch.first else decayed


def _add_cut_piece(pieces: _CutPieces, w: Weight, lay: _Layout) -> None:
    """Rank 0's piece of `w` where its last dimension is cut inside a block: by TP/ETP (`col_split`),
    or by the data ranks (a vector's one dim; ZeRO-1's even column cut of a matrix whose leading
    dims do not split evenly: `params.busiest_elements`)."""
    d, ranks = lay.dims, _data_ranks(lay, w)
    if w.vector:
        if not pieces_hold_whole_blocks(w.cols, ranks):
            pieces.add(1, -(-w.cols // ranks), w.cols)
        return
    lead, rows, cols = local_shape(w, d)
    column_cut = not lay.fsdp and lead % ranks and (rows // lead) % ranks and cols % ranks == 0
    if column_cut:
        if not pieces_hold_whole_blocks(cols, ranks):
            pieces.add(rows, cols // ranks, w.cols)
        return
    split = getattr(d, w.col_split) if w.col_split else 1
    if not pieces_hold_whole_blocks(w.cols, split):
        pieces.add(busiest_rows(lead, rows, ranks), cols, w.cols)


def _foreach_peak(cfg: Config, c: _CutPieces) -> float:
    """The most bytes PrecisionAwareAdamW._step_group holds at once over chunk `c`, following its
    allocations on the CPU, op by op (tests/unit/test_plan_optim_workspace_audit13 measures them):
    fp32 copies of the gradients (unless fp32) and masters (unless fp32), 4N each, kept through
    the step; a bf16 moment's fp32 copy 4N, an fp8 one's dequantized rows 4P (padded to whole
    blocks: optim/blocks.py `_blocks`; 8P + 4B while made); the denominators 4N; quantizing an fp8
    moment 12P + 8F + 4B (the blocks, the quotient and its clamp; the rows' maxima and scales; the
    local scales), with sqrt(v) 4N more for the second moment; the remainder's join_fp32 and
    split_fp32, int64 bit arithmetic, 44N and 47N over what is held."""
    from moefold.optim.blocks import BLOCK

    o = cfg.optim
    n, padded, blocks, scales = c.elements, c.blocks * BLOCK, c.blocks, c.scales
    fp32_master = o.master_dtype == "fp32"
    held = 0 if fp32_master else 4 * n  # the gradients' fp32 copies
    peaks = [held + 44 * n] if o.master_dtype == "bf16+remainder" else []
    held += 0 if fp32_master else 4 * n  # the masters'
    kept = {"fp32": 0, "bf16": 4 * n, "fp8": 4 * padded}
    for dtype in (o.exp_avg_dtype, o.exp_avg_sq_dtype):
        peaks.append(held + (8 * padded + 4 * blocks if dtype == "fp8" else kept[dtype]))
        held += kept[dtype]
    held += 4 * n  # the denominators
    quantize = 12 * padded + 8 * scales + 4 * blocks
    if o.exp_avg_dtype == "fp8":
        peaks.append(held + quantize)
    if o.exp_avg_sq_dtype == "fp8":
        peaks.append(held + 4 * n + quantize)
    if o.master_dtype == "bf16+remainder":
        peaks.append(held + 47 * n)
    return float(max(peaks)) if n else 0.0


def _shapes(cfg: Config, lay: _Layout, imbalance: float) -> act.Shapes:
    d = lay.dims
    # Forward reads parameters in the master's dtype: FSDP gathers them in their own, ddp keeps them.
    return act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len // d.cp, d.tp, d.ep, d.etp,
                      compute_bytes(cfg), imbalance, MASTER_BYTES[cfg.optim.master_dtype])


def _chunk_activations(cfg: Config, chunk: Chunk, sh: act.Shapes, vocab: int) -> dict[str, int]:
    """One micro-batch's saved bytes of a model chunk, after memory.recompute / memory.offload."""
    out = dict(options.rope_tables_kept(cfg, sh))
    for run in layer_runs(cfg, chunk.layers):
        act._add(out, **_times(act.layer_bytes(cfg, run.layer, sh), run.count))
        act._add(out, **_times(options.layer_delta(cfg, run.layer, sh)[0], run.count))
    if chunk.first:
        act._add(out, **act.first_stage_bytes(cfg, sh))
    if chunk.last:
        act._add(out, **act.last_stage_bytes(cfg, sh, vocab))
    return out


def _times(parts: dict[str, int], count: int) -> dict[str, int]:
    """`count` layers' bytes of one layer's `parts`."""
    return {key: value * count for key, value in parts.items()}


def _fp8_weight_cache(cfg: Config, chunks: list[Chunk], sh: act.Shapes, dims: ParallelDims) -> float:
    """precision.fp8_weight_cache (fp8/weight_cache.py): each FP8 expert weight held in both of
    its GEMMs' layouts, 1 byte each per local element, for the whole run (scales, under 0.5%, not
    counted); the experts of bf16 layers and of fp8_exclude'd modules are not cached."""
    cached = sum(layer_params(cfg, run.layer).expert * run.count for ch in chunks
                 for run in layer_runs(cfg, ch.layers) if act.cached_fp8_experts(cfg, run.layer, sh))
    return 2.0 * cached / (dims.ep * dims.etp)


def _chunk_params(cfg: Config, chunk: Chunk, vocab: int) -> ParamSplit:
    total = ParamSplit()
    for run in layer_runs(cfg, chunk.layers):
        total += layer_params(cfg, run.layer) * run.count
    if chunk.first:
        total += embedding_params(cfg, vocab)
    if chunk.last:
        total += head_params(cfg, vocab)
    return total


BACKWARD_ONLY = "FSDP reduce-scatter (1 block, root grads)"


def _comm_buffers(cfg: Config, lay: _Layout, chunks: list[Chunk], sh: act.Shapes,
                  vocab: int) -> dict[str, float]:
    from moefold.models.transformer import is_moe_layer

    d, c, D = lay.dims, sh.act_bytes, cfg.model.dim
    layers = [run.layer for ch in chunks for run in layer_runs(cfg, ch.layers)]  # one of each run
    out: dict[str, float] = {}
    if d.ep * d.etp > 1 and any(is_moe_layer(cfg, i) for i in layers):
        if act.gathers_copies(cfg, sh):
            # combine's M copies' outputs in gathered order and their fp32 sums over K (the group's
            # tokens), reduce-scattered
            copies = act.gathered_copies(cfg, sh)
            out["all-gather (one MoE layer)"] = copies * D * c + copies // cfg.moe.top_k * D * act.FP32
        else:
            rows = max(_all_to_all_rows(cfg, act.block_shapes(cfg, i, sh))
                       for i in layers if is_moe_layer(cfg, i))
            out["all-to-all (one MoE layer)"] = rows * D * c
    first, last = any(ch.first for ch in chunks), any(ch.last for ch in chunks)
    if lay.fsdp2:
        out.update(_fsdp_buffers(cfg, lay, layers, sh, vocab, first, last))
    if d.pp > 1:
        out["pipeline send/recv"] = 2 * sh.tokens * D * c
    return out


def _fsdp_buffers(cfg: Config, lay: _Layout, layers: list[int], sh: act.Shapes, vocab: int,
                  first: bool, last: bool) -> dict[str, float]:
    """FSDP2's gathered parameters and, in backward, its reduce-scatter (`_reduce_scatter_bytes`)."""
    out: dict[str, float] = {}
    root, root_sent = _root_elements(cfg, lay, vocab, first, last)
    if root and lay.dense_shard > 1:
        out["FSDP root (embedding, head) gathered"] = sh.params * root_sent
    # The root's own all-gather, forward's first, holds its flat buffer beside the gathered
    # parameters for a moment, with no block gathered yet.
    root_buffer = root_sent * (lay.dense_shard > 1)
    gathered = max(root_buffer, *(_gathered_blocks(cfg, lay, i) for i in layers))
    if gathered:
        out["FSDP all-gather (2 blocks)"] = sh.params * gathered
    moments = _reduce_scatters(cfg, lay, layers, vocab, first, last)
    if moments:
        out[BACKWARD_ONLY] = max(moments)
    return out


def _root_elements(cfg: Config, lay: _Layout, vocab: int, first: bool, last: bool) -> tuple[float, float]:
    """(elements, gathered or send-buffer elements, rows padded) of the root's parameters on this
    rank: the embedding where it holds the first chunk, the final norm, head and MTP modules where
    it holds the last."""
    root = _chunk_params(cfg, Chunk(-1, range(0), first, last), vocab).replicated
    return root, _padded_elements(_root_weights(cfg, vocab, first, last), lay.dims, lay.dense_shard,
                                  lay.expert_shard)


def _reduce_scatters(cfg: Config, lay: _Layout, layers: list[int], vocab: int, first: bool,
                     last: bool) -> tuple[float, float] | None:
    """`_reduce_scatter_moments` of this rank's blocks (`layers`: one of each kind) and root; None
    where it reduces nothing."""
    root, root_sent = _root_elements(cfg, lay, vocab, first, last)
    # The head's backward (backward's first) makes the root's gradients, tied embeddings' included;
    # the untied embedding's comes last, at the root's own reduce-scatter.
    tied = cfg.model.tie_embeddings and first
    root_grads = head_params(cfg, vocab).replicated * last + embedding_params(cfg, vocab).replicated * tied
    reduced = [_reduced_block(cfg, lay, i) for i in layers]
    if not (reduced or root):
        return None
    return _reduce_scatter_moments(cfg, reduced, root, root_grads, root_sent)


def _root_weights(cfg: Config, vocab: int, first: bool, last: bool) -> list[Weight]:
    return (embedding_weights(cfg, vocab) if first else []) + (head_weights(cfg, vocab) if last else [])


def _reduced_block(cfg: Config, lay: _Layout, layer_id: int) -> tuple[float, float]:
    """(elements, send-buffer elements) of one block's gradients FSDP2 reduce-scatters on this
    rank: every local parameter, a group over one rank included (FSDP2 copies it into a send
    buffer and out again all the same)."""
    from moefold.models.transformer import is_moe_layer

    local = sum(_local(layer_params(cfg, layer_id), lay.dims))
    weights = block_weights(cfg, is_moe_layer(cfg, layer_id))
    return local, _padded_elements(weights, lay.dims, lay.dense_shard, lay.expert_shard)


def _padded_elements(weights: list[Weight], dims: ParallelDims, dense_ranks: int,
                     expert_ranks: int) -> float:
    """Elements of the send buffers of `weights`' local tensors: FSDP2 pads each one's dim 0 to a
    multiple of its data ranks (a 257-row vocabulary sends 258 rows over 2, a 64-wide norm 66 over
    3). An expert weight whose local experts do not split evenly is cut on dim 1 instead
    (parallel/data.py's `even_expert_shards`), which must split evenly: no padding."""
    total = 0.0
    for w in weights:
        ranks = expert_ranks if w.expert else dense_ranks
        if w.vector:
            total += math.ceil(w.cols / ranks) * ranks
            continue
        lead, rows, cols = local_shape(w, dims)
        if w.expert and _dim1_elements(w, dims, ranks):
            total += rows * cols
            continue
        total += math.ceil(lead / ranks) * ranks * rows // lead * cols
    return total


def _reduce_scatter_moments(cfg: Config, blocks: list[tuple[float, float]], root: float,
                            root_grads: float, root_sent: float) -> tuple[float, float]:
    """FSDP2's unsharded gradients and reduce-scatter send buffers at their most in backward (torch
    2.13's foreach_reduce). A group's gradients, in the master's dtype, are copied into a send
    buffer in the reduce dtype (optim.grad_dtype; a bf16 master's own), each parameter's dim 0
    padded to a multiple of the ranks (`blocks`: each block's (elements, send-buffer elements)),
    before they are freed, and FSDP2 keeps that buffer until the next group's post-backward (one in
    flight, its default). A group over one rank is copied so too. The root (embedding, head, final
    norm) reduce-scatters last; its head's gradients stay unsharded from the head's backward on
    (the plan counts them here, not among the sharded gradients). A block is taken whole,
    gradients and buffer: FSDP2 reduces a MoE block's experts and the rest as two groups, so this
    exceeds the real most by up to master + reduce bytes per element of the smaller group.
    Two moments: while the blocks reduce (the head's gradients and a block's), and at the root's
    reduce-scatter, after every block's (its sharded gradients then all made)."""
    master, reduce = MASTER_BYTES[cfg.optim.master_dtype], _reduce_bytes(cfg)
    block = max((master * n + reduce * sent for n, sent in blocks), default=0.0)
    return master * root_grads + block, master * root + reduce * root_sent


def _reduce_bytes(cfg: Config) -> int:
    """Bytes an element of the data-parallel gradient reduction: optim.grad_dtype's (bf16), else the
    master's."""
    return 2 if cfg.optim.grad_dtype == "bf16" else MASTER_BYTES[cfg.optim.master_dtype]


def _all_to_all_rows(cfg: Config, sh: act.Shapes) -> int:
    """Rows one MoE layer's all-to-all sends and receives on the busiest rank (parallel/expert.py):
    out, its T/tp·K copies once for each ETP rank of their expert's EP index; in, its experts' rows
    less their padding (`imbalance` included). Padded to capacity, etp·E·C rows each way."""
    rows = act.expert_rows(cfg, sh)
    if padded_capacity(cfg.moe) is not None:
        return 2 * rows
    sent = sh.tokens // sh.tp * cfg.moe.top_k * sh.etp
    return sent + rows - cfg.moe.num_experts // sh.ep * (act.row_multiple(cfg, sh) - 1)


def _gathered_blocks(cfg: Config, lay: _Layout, layer_id: int) -> float:
    """Elements of FSDP2's gathered parameters at their most around one block on this rank (parts
    sharded over one rank need none), each tensor's dim 0 padded to a multiple of the ranks as
    FSDP2 gathers it: two blocks (the current and the prefetched one), or, where its expert
    weights are cut on dim 1, the block with its experts' flat all-gather buffer and the copy
    FSDP2 makes of those weights before chunk-catting them into place (torch 2.13's
    foreach_all_gather_copy_out)."""
    from moefold.models.transformer import is_moe_layer

    weights = block_weights(cfg, is_moe_layer(cfg, layer_id))
    d, dense_ranks, expert_ranks = lay.dims, lay.dense_shard, lay.expert_shard
    dense = _padded_elements([w for w in weights if not w.expert], d, dense_ranks, expert_ranks)
    expert = _padded_elements([w for w in weights if w.expert], d, dense_ranks, expert_ranks)
    block = dense * (dense_ranks > 1) + expert * (expert_ranks > 1)
    cut_on_dim1 = sum(_dim1_elements(w, d, expert_ranks) for w in weights if w.expert)
    return max(2 * block, block + expert + cut_on_dim1) if cut_on_dim1 else 2 * block


def _dim1_elements(w: Weight, dims: ParallelDims, ranks: int) -> float:
    """Local elements of expert weight `w` where FSDP2 cuts it on dim 1 (parallel/data.py's
    `even_expert_shards`: its local experts do not split evenly over the ranks, its dim 1 does)."""
    lead, rows, cols = local_shape(w, dims)
    cut = ranks > 1 and lead % ranks and (rows // lead) % ranks == 0
    return rows * cols if cut else 0.0


@dataclass(frozen=True)
class _LayerCost:
    """One layer of a run (bytes)."""
    full: int  # the plain layer's saved activations
    saved: int  # ... after memory.recompute / memory.offload
    copies: int  # the weight copies among `saved`
    work: int  # its backward working set
    gradients: float


def _visits(run: Run) -> list[int]:
    """The layers of `run` a walk evaluates (positions in it): its first and last, where what the
    walk holds changes by the same amount with every layer (none in a period's middle
    repetitions, plan.layers)."""
    return sorted({0, run.count - 1}) if run.walked else []


@dataclass(frozen=True)
class _Rank:
    """What the time-ordered peaks of one rank are made of (bytes)."""
    states: dict[str, float]  # parameters, gradients, master_weights, optimizer_moments, fp8_weight_cache
    activations: float  # every in-flight micro-batch's saved activations
    layers: list[tuple[Run, _LayerCost]]  # the last local chunk's layers, in forward order
    head: tuple[float, float, float]  # the loss's forward and backward workspace, head gradients
    running: list[tuple[float, float]]  # the last local chunk's recomputed or offloaded layers
    # while their forward runs: (the activations held, the layer's tensors beyond what it keeps)
    head_backward: tuple[float, float]  # what the heads kept, freed by the head's backward (the
    # log-probabilities, or the chunked loss's dh and dW), and its working set (plan.head)
    accumulating: bool  # gradients already exist when forward starts (micro-batches accumulate)
    comm: dict[str, float]
    optimizer: float
    after_backward: list[dict[str, float]]  # the optimizer step's moments (`_after_backward`)
    reduce_scatters: tuple[float, float] | None = None  # FSDP2's, while the blocks reduce and at
    # the root's (`_reduce_scatter_moments`; the comm row is their most); None without FSDP2


def _phases(r: _Rank) -> dict[str, dict[str, float]]:
    """Forward, backward and optimizer-step peaks, each as the parts held at that moment."""
    st = r.states
    grads = st["gradients"]
    held = {k: v for k, v in st.items() if k != "gradients"}
    before = grads if r.accumulating else 0.0
    comm_fwd = sum(v for k, v in r.comm.items() if k != BACKWARD_ONLY)
    fwd_ws, loss_bwd_ws, head_grads = r.head
    # Forward ends at the loss, or peaks inside a layer whose recompute or offload lets go, only
    # as the layer returns, of tensors its forward made.
    forward = max(({**held, "gradients": before, "activations": acts, "transient": work,
                    "communication": comm_fwd} for acts, work in [(r.activations, fwd_ws), *r.running]),
                  key=lambda parts: sum(parts.values()))
    # Backward, in reverse: the loss first, then each layer of the last chunk (whose micro-batch
    # is backpropagated at the in-flight peak); layers above i have freed their activations.
    # Under FSDP2 the blocks' reduce-scatters hold a block's unsharded gradients meanwhile, and the
    # root's, after them, every block's sharded ones.
    head_saved, head_grad_ws = r.head_backward
    blocks_reducing, root_reducing = r.reduce_scatters or (0.0, 0.0)
    steps = [(r.activations, loss_bwd_ws, 0.0, blocks_reducing),  # log-softmax's backward
             (r.activations - head_saved, head_grad_ws, head_grads, blocks_reducing)]  # the head's
    freed, made = head_saved, head_grads
    for run, cost in reversed(r.layers):  # a run's layers alike: its first and last are its extremes
        # FSDP2 makes a block's sharded gradients only as its reduce-scatter, which holds the
        # unsharded ones till then, ends.
        own = 0.0 if r.reduce_scatters else cost.gradients
        done = 0
        for k in _visits(run):
            made += (k - done) * cost.gradients
            freed += (k - done) * cost.saved
            # ... while the weight copies they replace are released
            steps.append((r.activations - freed - cost.copies, cost.work, made + own, blocks_reducing))
            made += cost.gradients
            freed += cost.saved
            done = k + 1
        made += (run.count - done) * cost.gradients
        freed += (run.count - done) * cost.saved
    if r.reduce_scatters:  # the root's reduce-scatter, the last
        steps.append((r.activations - freed, 0.0, made, root_reducing))
    backward = max(({**held, "gradients": grads if r.accumulating else made, "activations": acts,
                     "transient": work, "communication": comm_fwd + reducing}
                    for acts, work, made, reducing in steps),
                   key=lambda parts: sum(parts.values()))
    step = max(({**held, **parts} for parts in r.after_backward), key=lambda parts: sum(parts.values()))
    return {"forward": forward, "backward": backward, "optimizer step": step}


def _rank_reduce_scatters(cfg: Config, lay: _Layout, chunks: list[Chunk],
                          vocab: int) -> tuple[float, float] | None:
    """FSDP2's reduce-scatter moments on a rank of `chunks` (`_reduce_scatters`); None without FSDP2."""
    if not lay.fsdp2:
        return None
    layers = [run.layer for ch in chunks for run in layer_runs(cfg, ch.layers)]
    return _reduce_scatters(cfg, lay, layers, vocab, any(ch.first for ch in chunks), any(ch.last for ch in chunks))


def _layer_cost(cfg: Config, lay: _Layout, layer_id: int, sh: act.Shapes) -> _LayerCost:
    full = act.layer_bytes(cfg, layer_id, sh)
    delta = options.layer_delta(cfg, layer_id, sh)[0]
    # A layer's backward working set: its saved activations (a recomputed layer rebuilds them),
    # less the weight copies, and less the experts' [R, F] tensors, which backward frees one by
    # one as it makes their same-sized gradients (the activation's backward is written out,
    # moe/activation.py, and keeps no graph of its own).
    work = sum(full.values()) - full.get("weight_copies", 0) - full.get("experts", 0)
    return _LayerCost(sum(full.values()), sum(full.values()) + sum(delta.values()),
                      full.get("weight_copies", 0) + delta.get("weight_copies", 0), work,
                      _block_gradients(cfg, lay, layer_id))


def _block_gradients(cfg: Config, lay: _Layout, layer_id: int) -> float:
    """The bytes of one block's gradients on this rank. Under FSDP2 its reduce-scatter gives the
    busiest (first) rank of a group each tensor's dim 0 padded to a multiple of the ranks, over
    them (22 of 64 rows over 3: `busiest_elements`)."""
    from moefold.models.transformer import is_moe_layer

    if not lay.fsdp2:
        return _gradients(cfg, lay, layer_params(cfg, layer_id))
    weights = block_weights(cfg, is_moe_layer(cfg, layer_id))
    shard = sum(busiest_elements(w, lay.dims, _data_ranks(lay, w), False) for w in weights)
    return MASTER_BYTES[cfg.optim.master_dtype] * shard


def _running(layers: list[tuple[Run, _LayerCost]], held: int) -> list[tuple[int, int]]:
    """The last chunk's recomputed or offloaded layers while their forward runs, from `held`
    activations before its first layer: (the activations held, the layer's tensors beyond what it
    keeps). Such a layer's forward makes every tensor the plain layer keeps, and drops (or moves
    to the host) what it does not keep only as it goes: held at its most."""
    running = []
    for run, cost in layers:
        done = 0
        for k in _visits(run):
            held += (k - done) * cost.saved
            if cost.full > cost.saved:
                running.append((held + cost.saved, cost.full - cost.saved))
            held += cost.saved
            done = k + 1
        held += (run.count - done) * cost.saved
    return running


def _rank_plan(cfg: Config, lay: _Layout, chunks: list[Chunk], rank: int, sh: act.Shapes,
               vocab: int, micro_batches: int) -> MemoryPlan:
    d = lay.dims
    mine = rank_chunks(chunks, d.pp, rank)
    per_chunk = [_chunk_activations(cfg, ch, sh, vocab) for ch in mine]
    flight = peak_in_flight([sum(b.values()) for b in per_chunk], micro_batches, d.pp, rank)
    activations: dict[str, float] = {}
    offloaded = sum(n * sum(options.layer_delta(cfg, run.layer, sh)[1] * run.count
                            for run in layer_runs(cfg, ch.layers)) for n, ch in zip(flight.per_chunk, mine))
    for n, b in zip(flight.per_chunk, per_chunk):
        for key, value in b.items():
            activations[key] = activations.get(key, 0) + n * value
    split = ParamSplit()
    for ch in mine:
        split += _chunk_params(cfg, ch, vocab)
    local, sharded = _local(split, d), _busiest_shards(cfg, lay, mine, vocab)
    fp8_moments = "fp8" in (cfg.optim.exp_avg_dtype, cfg.optim.exp_avg_sq_dtype)
    states = _states(cfg, lay, *local, sharded, _scale_blocks(cfg, lay, mine, vocab) if fp8_moments else 0.0)
    states["fp8_weight_cache"] = _fp8_weight_cache(cfg, mine, sh, d)
    last = mine[-1]
    layers = [(run, _layer_cost(cfg, lay, run.layer, sh)) for run in layer_runs(cfg, last.layers)]
    # While a layer of the last chunk runs forward, the layers after it and the heads have saved
    # nothing yet of the micro-batch at the peak.
    held = sum(activations.values()) - (sum(act.last_stage_bytes(cfg, sh, vocab).values()) if last.last else 0)
    held -= sum(cost.saved * run.count for run, cost in layers)
    running = _running(layers, held)
    head, head_backward = (0.0, 0.0, 0.0), (0.0, 0.0)
    if last.last:  # forward ends, and backward starts, at the last head (an MTP depth's, if any)
        heads = head_losses(cfg, sh, vocab)
        # FSDP2 keeps the head's gradients unsharded until the root reduce-scatters them, after
        # every block: the reduce-scatter row holds them, and their shards come after backward.
        head_grads = 0.0 if lay.fsdp2 else _gradients(cfg, lay, head_params(cfg, vocab))
        head = (heads[-1].forward_workspace(), heads[-1].backward_workspace(), head_grads)
        head_backward = (sum(h.freed_in_backward() for h in heads), heads[-1].grad_workspace())
    optimizer = _optimizer_step(cfg, lay, mine, vocab)
    r = _Rank(states, sum(activations.values()), layers, head, running, head_backward,
              micro_batches > 1 or d.pp > 1, _comm_buffers(cfg, lay, mine, sh, vocab), optimizer,
              _after_backward(cfg, lay, *local, sharded, states["gradients"], optimizer),
              _rank_reduce_scatters(cfg, lay, mine, vocab))
    transient = max([head[0], head[1]] + [cost.work for _, cost in layers] + [w for _, w in running])
    return MemoryPlan(world_size=d.world, pp_rank=rank, layers=LayerIds(tuple(ch.layers for ch in mine)),
                      **states, activations=activations, in_flight=flight.per_chunk,
                      transient=transient, comm_buffers=r.comm, optimizer_step=r.optimizer,
                      phases=_phases(r), offloaded=offloaded)


def predict_memory(cfg: Config, world_size: int, imbalance: float = 1.0,
                   vocab_size: int = 0) -> MemoryPlan:
    """The plan of the busiest GPU of `cfg` on `world_size` GPUs. `imbalance` (>= 1) multiplies
    the rows the busiest expert rank computes; `vocab_size` 0 takes the config's (or its
    tokenizer's, as training would)."""
    if not 1 <= imbalance < math.inf:
        raise ConfigError(f"--moe-imbalance={imbalance} must be a finite number >= 1 (1 is perfectly "
                          "balanced routing)")
    lay = _layout(cfg, world_size)
    if imbalance > lay.dims.ep:  # every rank's copies on one expert rank is the most it can get
        raise ConfigError(f"--moe-imbalance={imbalance} exceeds parallel.ep={lay.dims.ep}: the busiest of "
                          f"{lay.dims.ep} expert ranks computes at most {lay.dims.ep}× its balanced share")
    vocab = vocab_size or model_vocab_size(cfg)
    refuse_unbuildable(cfg, vocab, torch.float32 if compute_bytes(cfg) == 4 else torch.bfloat16, lay)
    chunks = model_chunks(cfg.model.n_layers, cfg.model.mtp_layers, lay.dims.pp, cfg.parallel.vpp)
    configured = micro_batches_per_step(cfg.train, lay.dims.dp)  # refused as the trainer refuses it
    micro_batches = schedule_micro_batches(configured, lay.dims.pp)
    sh = _shapes(cfg, lay, imbalance)
    plans = [_rank_plan(cfg, lay, chunks, r, sh, vocab, micro_batches) for r in range(lay.dims.pp)]
    busiest = max(plans, key=lambda p: p.peak)
    busiest.rank_peaks = [p.peak for p in plans]
    if micro_batches != configured:
        why = ("the schedule's steady state; set train.global_batch_size for the real number"
               if configured < lay.dims.pp else f"rounded up to a multiple of parallel.pp={lay.dims.pp}")
        busiest.notes.append(f"{configured} micro-batch(es) per step on a {lay.dims.pp}-stage "
                             f"pipeline: planned with {micro_batches} ({why})")
    return busiest
