"""Where a step's time goes: a torch.profiler trace of a few steps and its breakdown into GEMM,
attention, communication and other work.

On a GPU the CUDA kernels are classified by name (NCCL first, then attention: flash-attention
kernels carry "cutlass" in their template arguments); on the CPU the aten ops, each op inside an
attention op counting as attention, and gloo's collectives (the c10d op and the ops inside it on
the calling thread, the gloo:<op> event on gloo's worker thread) as communication. Shares are of
the profiled wall time per step, so on a GPU the share "outside" GEMM and attention includes idle
gaps between kernels.

Communication kernels run on their own streams and may overlap compute. The *exposed* part is what
no compute kernel overlaps: the time the step waits on the network. It is reported for all NCCL
kernels and for the expert all-to-all alone (NCCL implements all_to_all_single as grouped
send/recv: `SendRecv` kernels; FSDP's all-gathers and reduce-scatters are the rest).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from moefold.bench.timing import synchronize

COMM_KERNEL = re.compile(r"nccl", re.IGNORECASE)
ALL_TO_ALL_KERNEL = re.compile(r"SendRecv|AllToAll", re.IGNORECASE)
ATTENTION_KERNEL = re.compile(r"flash|fmha|sdpa|attention", re.IGNORECASE)
GEMM_KERNEL = re.compile(r"gemm|cutlass|cublas|grouped|nvjet|sm90_xmma|xmma", re.IGNORECASE)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}
ATTENTION_OP = re.compile(r"scaled_dot_product|attention", re.IGNORECASE)
# A collective as called (c10d, functional collectives: their waits and autograd nodes too) and
# gloo's worker running it.
COMM_OP = re.compile(r"^(c10d::|gloo:)|c10d_functional")
CLASSES = ("gemm", "attention", "comm", "other")


def classify_kernel(name: str) -> str:
    if COMM_KERNEL.search(name):
        return "comm"
    if name.startswith("triton_"):  # Inductor: GEMM templates, else fused pointwise/reduction
        return "gemm" if name.startswith("triton_tem") else "other"  # (named after the ops they feed)
    if ATTENTION_KERNEL.search(name):
        return "attention"
    return "gemm" if GEMM_KERNEL.search(name) else "other"


def classify_cpu_op(name: str, ancestors: Iterable[str] = ()) -> str:
    if COMM_OP.search(name) or any(COMM_OP.search(a) for a in ancestors):
        return "comm"
    if ATTENTION_OP.search(name) or any(ATTENTION_OP.search(a) for a in ancestors):
        return "attention"
    return "gemm" if name in GEMM_OPS else "other"


def profile_steps(step: Callable[[], object], device: torch.device, steps: int,
                  trace_dir: Path, trace_name: str = "trace.json") -> dict[str, Any]:
    """Run `steps` calls of `step` under the profiler, write trace_dir/trace_name (Chrome trace
    format) and return the breakdown per step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_s = time.perf_counter() - start
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir / trace_name
    prof.export_chrome_trace(str(trace))
    if device.type != "cuda":
        timed, device_fields = _cpu_ops(prof.events()), {"unit": "cpu ops"}
    else:
        kernels = _device_kernels(prof.events())
        timed = [(name, kind, end - start) for name, kind, start, end in kernels]
        device_fields = {**exposed_communication(kernels, steps), "unit": "kernels",
                       "idle_ms": device_idle_ms(kernels, wall_s * 1e6, steps)}
    table = trace_dir / trace_name.replace("trace", "by-name").replace(".json", ".tsv")
    write_by_name(by_name(timed, steps), table)
    return {"trace": str(trace), "by_name": str(table), **breakdown(timed, wall_s / steps * 1e6, steps),
            **device_fields}


def _device_kernels(events) -> list[tuple[str, str, float, float]]:
    """(name, class, start µs, end µs) of every kernel, memcpy and memset on the device (not the
    GPU-side ranges of record_function annotations, which span kernels)."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False):
            out.append((e.name, classify_kernel(e.name), float(e.time_range.start), float(e.time_range.end)))
    return out


Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _uncovered(intervals: list[Interval], cover: list[Interval]) -> float:
    """Total length of the (disjoint, sorted) `intervals` outside the (disjoint, sorted) `cover`."""
    total, j = 0.0, 0
    for start, end in intervals:
        covered = 0.0
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            covered += min(end, cover[k][1]) - max(start, cover[k][0])
            k += 1
        total += (end - start) - covered
    return total


def device_idle_ms(kernels: list[tuple[str, str, float, float]], wall_us: float, steps: int) -> float:
    """Per-step ms in which no kernel runs on the device: launch gaps and host waits, the part of
    the step that CUDA graphs or fewer host syncs could win back."""
    busy_us = sum(e - s for s, e in _union((s, e) for _, _, s, e in kernels))
    return max(0.0, wall_us - busy_us) / steps / 1e3


def exposed_communication(kernels: list[tuple[str, str, float, float]], steps: int) -> dict[str, float]:
    """Per-step ms of NCCL kernels (all, and the all-to-all alone) and of the part of each that no
    compute kernel overlaps."""
    compute = _union((s, e) for _, kind, s, e in kernels if kind != "comm")
    comm = _union((s, e) for _, kind, s, e in kernels if kind == "comm")
    a2a = _union((s, e) for name, kind, s, e in kernels if kind == "comm" and ALL_TO_ALL_KERNEL.search(name))
    ms = lambda us: us / steps / 1e3  # noqa: E731
    return {"comm_busy_ms": ms(sum(e - s for s, e in comm)), "comm_exposed_ms": ms(_uncovered(comm, compute)),
            "all_to_all_ms": ms(sum(e - s for s, e in a2a)),
            "all_to_all_exposed_ms": ms(_uncovered(a2a, compute))}


def _cpu_ops(events) -> list[tuple[str, str, float]]:
    """(name, class, self µs) of every CPU op; a collective's async event (gloo:<op>, on gloo's
    worker thread) counts its whole duration, which the profiler's self time gives as 0: the
    calling thread's wait in a synchronous collective is no op. So "comm" is the collectives'
    activity on both threads, like the GPU's comm_busy_ms, not a slice of the step: a functional
    collective's wait (_c10d_functional::wait_tensor) overlaps its worker's event."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        ancestors, parent = [], e.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        kind = classify_cpu_op(e.name, ancestors)
        us = e.cpu_time_total if e.is_async and kind == "comm" else e.self_cpu_time_total
        out.append((e.name, kind, float(us)))
    return out


def by_name(timed: list[tuple[str, str, float]], steps: int) -> list[dict[str, Any]]:
    """Every name's time and calls per step, the most time first; one row per name and class (a
    CPU op's class depends on its callers: aten::bmm inside attention or not)."""
    totals: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    for name, kind, us in timed:
        entry = totals[name, kind]
        entry[0], entry[1] = entry[0] + us, entry[1] + 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return [{"name": name, "class": kind, "ms_per_step": us / steps / 1e3, "calls_per_step": calls / steps}
            for (name, kind), (us, calls) in ranked]


def write_by_name(rows: list[dict[str, Any]], path: Path) -> None:
    """The whole by-name table as tab-separated text: where the top names leave off, this is what a
    comparison of two runs' kernels needs."""
    lines = ["ms_per_step\tcalls_per_step\tclass\tname"]
    lines += [f"{r['ms_per_step']:.6f}\t{r['calls_per_step']:g}\t{r['class']}\t{r['name']}" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def breakdown(timed: list[tuple[str, str, float]], step_us: float, steps: int,
              top: int = 15) -> dict[str, Any]:
    """Per-step milliseconds by class and the top names; shares of the step time in [0, 1]."""
    by_class = dict.fromkeys(CLASSES, 0.0)
    for _, kind, us in timed:
        by_class[kind] += us
    step_ms = step_us / 1e3
    ms = {k: v / steps / 1e3 for k, v in by_class.items()}
    share = {k: min(1.0, v / step_ms) if step_ms > 0 else 0.0 for k, v in ms.items()}
    busy_ms = sum(ms.values())
    return {
        "step_ms": step_ms, "busy_ms": busy_ms, "gemm_ms": ms["gemm"],
        "attention_ms": ms["attention"], "comm_ms": ms["comm"], "other_ms": ms["other"],
        "gemm_share": share["gemm"], "attention_share": share["attention"],
        "outside_share": max(0.0, 1.0 - share["gemm"] - share["attention"]),
        "top": [{**row, "share": min(1.0, row["ms_per_step"] / step_ms) if step_ms > 0 else 0.0}
                for row in by_name(timed, steps)[:top]],
    }


def format_profile(p: dict[str, Any]) -> str:
    head = f"{'ms/step':>9s} {'share':>6s} {'calls':>6s} {'class':9s} name"
    lines = [f"profile: {p['trace']}; every {p['unit'][:-1]} by name: {p['by_name']}",
             f"top {p['unit']} by self {'device' if p['unit'] == 'kernels' else 'CPU'} time "
             f"(per step of {p['step_ms']:.2f} ms, profiled):", head]
    for row in p["top"]:
        name = row["name"] if len(row["name"]) <= 90 else row["name"][:87] + "..."
        lines.append(f"{row['ms_per_step']:9.3f} {100 * row['share']:5.1f}% "
                     f"{row['calls_per_step']:6.1f} {row['class']:9s} {name}")
    comm = f", communication {p['comm_ms']:.2f} ms" if p.get("comm_ms") else ""
    lines.append(f"GEMM {p['gemm_ms']:.2f} ms ({100 * p['gemm_share']:.1f}%), attention "
                 f"{p['attention_ms']:.2f} ms ({100 * p['attention_share']:.1f}%){comm}, other "
                 f"{p['unit']} {p['other_ms']:.2f} ms; outside GEMM and attention: "
                 f"{100 * p['outside_share']:.1f}% of the step")
    if "idle_ms" in p:
        lines.append(f"device idle (no kernel running) {p['idle_ms']:.2f} ms "
                     f"({100 * p['idle_ms'] / p['step_ms']:.1f}% of the step)")
    if p.get("comm_busy_ms"):
        step = p["step_ms"]
        lines.append(f"communication (NCCL kernels) {p['comm_busy_ms']:.2f} ms, exposed "
                     f"{p['comm_exposed_ms']:.2f} ms ({100 * p['comm_exposed_ms'] / step:.1f}% of the "
                     f"step); all-to-all {p['all_to_all_ms']:.2f} ms, exposed "
                     f"{p['all_to_all_exposed_ms']:.2f} ms ({100 * p['all_to_all_exposed_ms'] / step:.1f}%)")
    return "\n".join(lines)
