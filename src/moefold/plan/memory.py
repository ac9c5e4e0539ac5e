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
    remainder (2) all sharded over dp·cp (dense) or edp (experts).
  - `ddp`: a distributed (ZeRO-1) optimizer, as Megatron's: parameters in the compute dtype (bf16 2,
    or fp32 4 when both compute and master are fp32) and gradients in the master's dtype replicated;
    an fp32 master copy (4, when the parameters are bf16), the remainder and the moments sharded over
    dp·cp / edp.
  - moments: fp32 4, bf16 2, fp8 1 + one fp32 scale per 128 elements.
- **Activations** (`plan.activations`): saved-for-backward bytes of one micro-batch per model chunk,
  times the micro-batches in flight on the rank under Megatron-Core's 1F1B / interleaved schedule
  (`plan.pipeline`). Routing is assumed balanced; `imbalance` scales the busiest rank's rows.
- **Transients**: the larger of the loss workspace (logits and their fp32 copy or gradients, on the
  rank with the head) and a backward working set taken as one layer's saved activations (an
  estimate, not measured).
- **Communication buffers**: the all-to-all send and receive buffers of one MoE layer (ep·etp > 1),
  FSDP2's all-gathered compute-dtype parameters of two blocks (the current and the prefetched one)
  and one block's fp32 gradients to reduce-scatter, the pipeline's send/receive of one micro-batch.
- **Optimizer step**: PrecisionAwareAdamW updates one tensor at a time in fp32 (about five fp32
  copies of the largest local tensor); it runs after backward, so the peak is the static memory plus
  the larger of the forward/backward peak and this.
Not modelled: the CUDA context, NCCL's own buffers and allocator fragmentation (a few GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moefold.config import Config
from moefold.errors import ConfigError
from moefold.parallel.dims import ParallelDims
from moefold.plan import activations as act
from moefold.plan import options
from moefold.plan.params import ParamSplit, embedding_params, head_params, layer_params
from moefold.plan.pipeline import (
    Chunk,
    model_chunks,
    peak_in_flight,
    rank_chunks,
    schedule_micro_batches,
)

GIB = 1024 ** 3
DEVICES_GB = {"h100": 80, "h200": 141, "b200": 180, "gb200": 186}
"""Memory per GPU as marketed, in GB (10^9 bytes)."""
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}
MASTER_BYTES = {"fp32": 4, "bf16": 2, "bf16+remainder": 2}


@dataclass
class MemoryPlan:
    """Predicted bytes on the busiest GPU (the pipeline rank with the highest peak)."""
    world_size: int
    pp_rank: int
    layers: tuple[int, ...]  # layer ids on this rank (MTP blocks numbered on from n_layers)
    parameters: float
    gradients: float
    master_weights: float
    optimizer_moments: float
    activations: dict[str, float]  # by category (plan.activations.CATEGORIES), all in-flight
    in_flight: tuple[int, ...]  # micro-batches live per local chunk at the peak
    transient: float
    comm_buffers: dict[str, float]
    optimizer_step: float
    offloaded: float = 0.0  # saved activations memory.offload keeps in host memory instead
    rank_peaks: list[float] = field(default_factory=list)  # every pipeline rank's peak
    notes: list[str] = field(default_factory=list)

    @property
    def static(self) -> float:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_moments

    @property
    def activation_total(self) -> float:
        return sum(self.activations.values())

    @property
    def peak(self) -> float:
        step = self.activation_total + self.transient + sum(self.comm_buffers.values())
        return self.static + max(step, self.optimizer_step)

    def fits(self, capacity_bytes: float) -> bool:
        return self.peak <= capacity_bytes


@dataclass(frozen=True)
class _Layout:
    dims: ParallelDims
    dense_shard: int  # ranks sharing one dense parameter's optimizer state (dp·cp)
    expert_shard: int  # ... one expert parameter's (edp)
    fsdp: bool


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


def _states(cfg: Config, lay: _Layout, dense: float, expert: float) -> dict[str, float]:
    o, c = cfg.optim, compute_bytes(cfg)
    master = MASTER_BYTES[o.master_dtype]
    remainder = 2 if o.master_dtype == "bf16+remainder" else 0
    sharded = dense / lay.dense_shard + expert / lay.expert_shard
    moments = MOMENT_BYTES[o.exp_avg_dtype] + MOMENT_BYTES[o.exp_avg_sq_dtype]
    if lay.fsdp:
        return {"parameters": master * sharded, "gradients": master * sharded,
                "master_weights": remainder * sharded, "optimizer_moments": moments * sharded}
    param = 4 if c == 4 and master == 4 else 2
    master_copy = 4 if master == 4 and param == 2 else remainder
    return {"parameters": param * (dense + expert), "gradients": master * (dense + expert),
            "master_weights": master_copy * sharded, "optimizer_moments": moments * sharded}


def _optimizer_step(cfg: Config, lay: _Layout, split: ParamSplit) -> float:
    """PrecisionAwareAdamW's fp32 working copies of its largest tensor (fused AdamW: none)."""
    o = cfg.optim
    if (o.exp_avg_dtype, o.exp_avg_sq_dtype, o.master_dtype) == ("fp32", "fp32", "fp32"):
        return 0.0
    d = lay.dims
    largest = max(split.largest_dense / lay.dense_shard,
                  split.largest_expert / (d.ep * d.etp * lay.expert_shard))
    return 5 * 4 * largest  # grad, master, two moments and the denominator in fp32


def _shapes(cfg: Config, lay: _Layout, imbalance: float) -> act.Shapes:
    d = lay.dims
    return act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len // d.cp, d.tp, d.ep, d.etp,
                      compute_bytes(cfg), imbalance)


def params_in_compute_dtype(cfg: Config) -> bool:
    """Parameters stored in the compute dtype (bf16 master, or fp32 compute): a linear then keeps
    its input itself, not an autocast copy of it."""
    return compute_bytes(cfg) == 4 or cfg.optim.master_dtype != "fp32"


def _chunk_activations(cfg: Config, chunk: Chunk, sh: act.Shapes, vocab: int) -> dict[str, int]:
    """One micro-batch's saved bytes of a model chunk, after memory.recompute / memory.offload."""
    out = {"attn_core": act.rope_table_bytes(cfg, sh) - options.rope_offloaded(cfg, sh)}
    for layer_id in chunk.layers:
        act._add(out, **act.layer_bytes(cfg, layer_id, sh))
        act._add(out, **options.layer_delta(cfg, layer_id, sh, params_in_compute_dtype(cfg))[0])
    if chunk.first:
        act._add(out, **act.first_stage_bytes(cfg, sh))
    if chunk.last:
        act._add(out, **act.last_stage_bytes(cfg, sh, vocab))
    return out


def _chunk_params(cfg: Config, chunk: Chunk, vocab: int) -> ParamSplit:
    total = ParamSplit()
    for layer_id in chunk.layers:
        total += layer_params(cfg, layer_id)
    if chunk.first:
        total += embedding_params(cfg, vocab)
    if chunk.last:
        total += head_params(cfg, vocab)
    return total


def _comm_buffers(cfg: Config, lay: _Layout, chunks: list[Chunk], sh: act.Shapes) -> dict[str, float]:
    from moefold.models.transformer import is_moe_layer

    d, c, D = lay.dims, sh.act_bytes, cfg.model.dim
    layers = [i for ch in chunks for i in ch.layers]
    out: dict[str, float] = {}
    if d.ep * d.etp > 1 and any(is_moe_layer(cfg, i) for i in layers):
        out["all-to-all (one MoE layer)"] = 2 * sh.tokens // d.tp * cfg.moe.top_k * D * c
    if lay.fsdp:
        block = max(_fsdp_block(cfg, lay, i) for i in layers)
        if block:
            out["FSDP all-gather (2 blocks)"] = 2 * c * block
            out["FSDP reduce-scatter (1 block)"] = 4 * block
    if d.pp > 1:
        out["pipeline send/recv"] = 2 * sh.tokens * D * c
    return out


def _fsdp_block(cfg: Config, lay: _Layout, layer_id: int) -> float:
    """Elements of one block FSDP gathers on this rank (parts sharded over one rank need none)."""
    dense, expert = _local(layer_params(cfg, layer_id), lay.dims)
    return dense * (lay.dense_shard > 1) + expert * (lay.expert_shard > 1)


def _micro_batches(cfg: Config, lay: _Layout) -> int:
    t = cfg.train
    if t.global_batch_size:
        return max(1, t.global_batch_size // (t.micro_batch_size * lay.dims.dp))
    return t.grad_accum


def _rank_plan(cfg: Config, lay: _Layout, chunks: list[Chunk], rank: int, sh: act.Shapes,
               vocab: int, micro_batches: int) -> MemoryPlan:
    d = lay.dims
    mine = rank_chunks(chunks, d.pp, rank)
    per_chunk = [_chunk_activations(cfg, ch, sh, vocab) for ch in mine]
    flight = peak_in_flight([sum(b.values()) for b in per_chunk], micro_batches, d.pp, rank)
    activations: dict[str, float] = {}
    offloaded = sum(n * (options.rope_offloaded(cfg, sh) + sum(
        options.layer_delta(cfg, i, sh, params_in_compute_dtype(cfg))[1] for i in ch.layers))
        for n, ch in zip(flight.per_chunk, mine))
    for n, b in zip(flight.per_chunk, per_chunk):
        for key, value in b.items():
            activations[key] = activations.get(key, 0) + n * value
    split = ParamSplit()
    for ch in mine:
        split += _chunk_params(cfg, ch, vocab)
    layer_peak = max(sum(act.layer_bytes(cfg, i, sh).values()) for ch in mine for i in ch.layers)
    loss = act.loss_workspace_bytes(sh, vocab) if any(ch.last for ch in mine) else 0
    return MemoryPlan(world_size=d.world, pp_rank=rank, layers=tuple(i for ch in mine for i in ch.layers),
                      **_states(cfg, lay, *_local(split, d)), activations=activations,
                      in_flight=flight.per_chunk, transient=max(layer_peak, loss),
                      comm_buffers=_comm_buffers(cfg, lay, mine, sh),
                      optimizer_step=_optimizer_step(cfg, lay, split), offloaded=offloaded)


def predict_memory(cfg: Config, world_size: int, imbalance: float = 1.0,
                   vocab_size: int = 0) -> MemoryPlan:
    """The plan of the busiest GPU of `cfg` on `world_size` GPUs. `imbalance` (>= 1) multiplies
    the rows the busiest expert rank computes; `vocab_size` 0 takes the config's (or the byte
    tokenizer's 257, as training would)."""
    if imbalance < 1:
        raise ConfigError(f"--moe-imbalance={imbalance} must be >= 1 (1 is perfectly balanced routing)")
    lay = _layout(cfg, world_size)
    vocab = vocab_size or cfg.model.vocab_size or 257
    chunks = model_chunks(cfg.model.n_layers, cfg.model.mtp_layers, lay.dims.pp, cfg.parallel.vpp)
    configured = _micro_batches(cfg, lay)
    micro_batches = schedule_micro_batches(configured, lay.dims.pp)
    sh = _shapes(cfg, lay, imbalance)
    plans = [_rank_plan(cfg, lay, chunks, r, sh, vocab, micro_batches) for r in range(lay.dims.pp)]
    busiest = max(plans, key=lambda p: p.peak)
    busiest.rank_peaks = [p.peak for p in plans]
    if micro_batches != configured:
        busiest.notes.append(f"{configured} micro-batch(es) per step on a {lay.dims.pp}-stage "
                             f"pipeline: planned with {micro_batches} (the schedule's steady state; "
                             "set train.global_batch_size for the real number)")
    return busiest
