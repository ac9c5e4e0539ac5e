"""The `moefold plan memory` table: one GPU's predicted memory by part, and whether it fits."""

from __future__ import annotations

from moefold.config import Config
from moefold.plan.memory import GIB, MemoryPlan, compute_bytes
from moefold.plan.pipeline import LayerIds

CATEGORY_LABELS = {
    "embedding": "embedding (token ids)",
    "norm": "norms (fp32 RMSNorm)",
    "attn_proj": "attention projections",
    "attn_core": "core attention (q, k, v, out)",
    "mlp": "dense MLP",
    "router": "router",
    "moe_dispatch": "MoE permutation",
    "experts": "routed experts",
    "shared_experts": "shared experts",
    "mtp_proj": "MTP projections",
    "head": "output head + loss",
    "weight_copies": "weight casts kept (autocast)",
    "kept_inputs": "inputs kept for recompute",
}
DTYPE_NAMES = {2: "bf16", 4: "fp32"}


def _layer_ranges(layers: LayerIds) -> str:
    """"0-3, 8-11": the ids of `layers`' ranges, adjacent ones joined."""
    spans: list[list[int]] = []
    for r in layers.ranges:
        if spans and spans[-1][1] + 1 == r.start:
            spans[-1][1] = r.stop - 1
        else:
            spans.append([r.start, r.stop - 1])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _header(plan: MemoryPlan, cfg: Config) -> list[str]:
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    world = plan.world_size
    dp, edp = world // (p.tp * p.cp * p.pp), world // (p.etp * p.ep * p.pp)
    layout = (f"{cfg.model.family}, {world} GPU{'' if world == 1 else 's'}: attention pp {p.pp} · dp {dp} · cp {p.cp} · "
              f"tp {p.tp}, experts pp {p.pp} · edp {edp} · ep {p.ep} · etp {p.etp}, vpp {p.vpp}, "
              f"{p.data_parallel}")
    precision = (f"micro-batch {t.micro_batch_size} × {t.seq_len} tokens, "
                 f"{DTYPE_NAMES[compute_bytes(cfg)]} compute, master {o.master_dtype}, "
                 f"moments {o.exp_avg_dtype}/{o.exp_avg_sq_dtype}")
    busiest = (f"busiest GPU: pipeline rank {plan.pp_rank}, layers {_layer_ranges(plan.layers)} "
               f"({len(plan.layers)}); micro-batches in flight per model chunk at the peak: "
               f"{', '.join(map(str, plan.in_flight))}")
    return [layout, precision, busiest]


def _row(label: str, value: float, indent: int = 0) -> str:
    return f"{' ' * indent}{label:<{44 - indent}}{value / GIB:>10.2f}"


def format_plan(plan: MemoryPlan, cfg: Config, capacity_gb: float, device: str) -> str:
    """The per-GPU breakdown in GiB, the peak, and the verdict against `capacity_gb` (10^9 bytes)."""
    lines = _header(plan, cfg) + ["", f"{'per GPU':<44}{'GiB':>10}"]
    lines += [_row("parameters", plan.parameters), _row("gradients", plan.gradients),
              _row("master weights / remainders", plan.master_weights),
              _row("optimizer moments", plan.optimizer_moments)]
    if plan.fp8_weight_cache:
        lines.append(_row("FP8 expert weights (fp8_weight_cache)", plan.fp8_weight_cache))
    lines.append(_row("activations (saved for backward)", plan.activation_total))
    for key, label in CATEGORY_LABELS.items():
        if plan.activations.get(key):
            lines.append(_row(label, plan.activations[key], indent=2))
    if plan.offloaded:
        lines.append(_row("  (offloaded to host memory, not counted)", plan.offloaded))
    lines.append(_row("transient (a layer's working set / loss)", plan.transient))
    lines.append(_row("communication buffers", sum(plan.comm_buffers.values())))
    lines += [_row(label, value, indent=2) for label, value in plan.comm_buffers.items()]
    lines.append(_row("optimizer step workspace (after backward)", plan.optimizer_step))
    lines.append("-" * 54)
    for phase, parts in plan.phases.items():  # what is held at each phase's own peak
        held = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in parts.items() if v)
        lines.append(_row(f"{phase} peak", plan.phase_peak(phase)) + f"   ({held})")
    lines += ["-" * 54, _row("peak (the largest phase)", plan.peak)]
    capacity = capacity_gb * 1e9
    verdict = "fits" if plan.fits(capacity) else "does NOT fit"
    margin = abs(capacity - plan.peak) / GIB
    lines.append(f"{verdict} on {device} ({capacity_gb:g} GB = {capacity / GIB:.1f} GiB): "
                 f"{margin:.1f} GiB {'left' if plan.fits(capacity) else 'over'}; not counted: CUDA "
                 "context, NCCL, allocator fragmentation")
    if len(plan.rank_peaks) > 1:
        lines.append("peak by pipeline rank (GiB): "
                     + " ".join(f"{r}:{v / GIB:.1f}" for r, v in enumerate(plan.rank_peaks)))
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
