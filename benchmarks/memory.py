"""Peak GPU memory of training steps against the memory planner, for optimizer-state precisions and
each `memory.recompute` / `memory.offload` option.

Each setting runs in a fresh process (so the allocator's peak starts clean): build the model from a
preset plus overrides directly on the GPU (random weights), the optimizer, then N training steps at
the configured micro-batch with random tokens under bf16 autocast (the Trainer's step: forward, loss,
backward, grad-norm clip, optimizer step, zero_grad). The first `--warmup` steps are not measured
(fused AdamW allocates its states in its first step); the peak is `torch.cuda.max_memory_allocated`
over the rest, also split by phase (forward, backward, optimizer step). The planner's
`predict_memory(cfg, 1)` peak and its forward / backward / optimizer-step peaks stand beside them.

    PYTHONPATH=$PWD/src python benchmarks/memory.py --config qwen3-30b-a3b --model.n_layers 6 \
        --train.micro_batch_size 4 --train.seq_len 4096 [--settings fp32,lean,...] [--steps 3] \
        [--out DIR] [--predict-only [--breakdown]]

Settings: `fp32` (all-fp32 optimizer states), `lean-bf16` (bf16 moments, bf16 + remainder master),
`lean` (fp8 moments, bf16 + remainder master: the recommended states), and `lean+recompute=NAME` /
`lean+offload=NAME` for each name the model has. `--predict-only` prints the planner's column alone
(no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GIB = 2 ** 30
STATES = {
    "fp32": {"optim.exp_avg_dtype": "fp32", "optim.exp_avg_sq_dtype": "fp32", "optim.master_dtype": "fp32"},
    "lean-bf16": {"optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "bf16",
                  "optim.master_dtype": "bf16+remainder"},
    "lean": {"optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8",
             "optim.master_dtype": "bf16+remainder"},
}


def setting_overrides(setting: str) -> dict[str, str]:
    """`lean+recompute=norm` → the lean states plus memory.recompute = ["norm"]."""
    base, _, extra = setting.partition("+")
    if base not in STATES:
        raise SystemExit(f"setting {setting!r}: the states must be one of {', '.join(STATES)}")
    out = dict(STATES[base])
    if extra:
        kind, _, name = extra.partition("=")
        if kind not in ("recompute", "offload") or not name:
            raise SystemExit(f"setting {setting!r}: write +recompute=NAME or +offload=NAME")
        out[f"memory.{kind}"] = f'["{name}"]'
    return out


def default_settings(cfg) -> list[str]:
    from moefold.config import load_config
    from moefold.errors import ConfigError

    names = []
    for name in ("norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp", "moe", "layer"):
        try:  # the config refuses names the model does not have
            load_config(None, {**_flat(cfg), "memory.recompute": f'["{name}"]'})
            names.append(name)
        except ConfigError:
            pass
    return (["fp32", "lean-bf16", "lean"] + [f"lean+recompute={n}" for n in names]
            + [f"lean+offload={n}" for n in names])


def _flat(cfg) -> dict:
    import dataclasses
    return {f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
            for section in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, section.name))}


def build_config(preset: str, overrides: dict[str, str], setting: str):
    from moefold.config import load_config
    return load_config(preset, {**overrides, **setting_overrides(setting)})


def predicted_gib(cfg) -> float:
    from moefold.plan import predict_memory
    return predict_memory(cfg, 1).peak / GIB


def predicted_phases(cfg) -> dict:
    """The planner's peak and its forward / backward / optimizer-step peaks, with what each holds."""
    from moefold.plan import predict_memory
    plan = predict_memory(cfg, 1)
    return {"predicted_gib": plan.peak / GIB,
            **{f"predicted_{p.split()[0]}_gib": plan.phase_peak(p) / GIB for p in plan.phases},
            "predicted_parts_gib": {p: {k: v / GIB for k, v in parts.items()}
                                    for p, parts in plan.phases.items()},
            "predicted_activations_gib": {k: v / GIB for k, v in plan.activations.items()}}


# ------------------------------------------------------------------------------ one setting


def run_one(cfg, steps: int, warmup: int, device_name: str = "cuda") -> dict:
    import torch

    from moefold.models.transformer import build_model
    from moefold.optim.adamw import build_optimizer
    from moefold.parallel.data import GradNormClipper
    from moefold.train.loss import build_objective

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    vocab = cfg.model.vocab_size or 257
    torch.manual_seed(cfg.train.seed)
    with device:  # built and initialised on the GPU: a 4B-parameter model in seconds
        model = build_model(cfg, vocab, device.type, torch.bfloat16).train()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, cfg.model.init_std)
    objective = build_objective(model)
    optimizer = build_optimizer(model, cfg.train, device, cfg.optim)
    clip = GradNormClipper(list(model.parameters()))
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    gen = torch.Generator(device).manual_seed(0)
    phases = {"forward": [], "backward": [], "optimizer": []}
    times, losses = [], []
    for step in range(steps):
        ids_BS = torch.randint(0, vocab, (B, S + 1), device=device, generator=gen)
        measured = step >= warmup
        if cuda:
            torch.cuda.synchronize()
            if step == warmup:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        marks = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, _ = objective(model, ids_BS[:, :-1], ids_BS[:, 1:])
        marks.append(_phase_peak(measured, cuda))
        total.backward()
        marks.append(_phase_peak(measured, cuda))
        clip(cfg.train.grad_clip or float("inf"))
        optimizer.step()
        model.on_optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(_phase_peak(measured, cuda))
        losses.append(total.item())
        if measured:
            times.append(time.perf_counter() - start)
            for name, value in zip(phases, marks):
                phases[name].append(value)
    offload = getattr(model, "activation_offload", None)
    return {"peak_gib": max(max(v) for v in phases.values()),
            **{f"{k}_peak_gib": max(v) for k, v in phases.items()},
            "static_gib": torch.cuda.memory_allocated() / GIB if cuda else 0.0,
            "step_s": statistics.median(times), "losses": losses,
            "offloaded_gib_per_step": (offload.offloaded_bytes / GIB / steps) if offload else 0.0,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def _phase_peak(measured: bool, cuda: bool) -> float:
    """Peak allocated since the last call, in GiB; then starts the next phase's peak."""
    import torch
    if not cuda:  # a CPU run checks the script, not memory
        return 0.0
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB
    if measured:
        torch.cuda.reset_peak_memory_stats()
    return peak


# ------------------------------------------------------------------------------ the table


def run_setting_in_subprocess(args, overrides: list[str], setting: str, out: Path) -> dict:
    path = out / f"{setting.replace('+', '_').replace('=', '-')}.json"
    cmd = [sys.executable, __file__, "--config", args.config, *overrides, "--one", setting,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
           "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
        return {"error": "OOM" if oom else "failed", "detail": " / ".join(tail)[-600:]}
    return json.loads(path.read_text())


def format_table(rows: dict[str, dict], reference: str = "fp32") -> str:
    ref = rows.get(reference, {}).get("peak_gib")
    head = (f"{'setting':28s} {'peak GiB':>9s} {'predicted':>9s} {'meas/pred':>9s} {'vs fp32':>8s} "
            f"{'fwd':>7s} {'bwd':>7s} {'optim':>7s} {'static':>7s} {'step s':>7s} {'offl GiB':>8s}")
    lines = [head, "-" * len(head)]
    for setting, r in rows.items():
        pred = r.get("predicted_gib")
        if "peak_gib" not in r:
            lines.append(f"{setting:28s} {r.get('error', '-'):>9s} {pred or 0:9.2f}")
            continue
        lines.append(
            f"{setting:28s} {r['peak_gib']:9.2f} {pred:9.2f} {r['peak_gib'] / pred:9.3f} "
            f"{(r['peak_gib'] / ref) if ref else float('nan'):8.3f} {r['forward_peak_gib']:7.2f} "
            f"{r['backward_peak_gib']:7.2f} {r['optimizer_peak_gib']:7.2f} {r['static_gib']:7.2f} "
            f"{r['step_s']:7.3f} {r['offloaded_gib_per_step']:8.2f}")
    return "\n".join(lines)


def _split_overrides(rest: list[str]) -> dict[str, str]:
    if len(rest) % 2 or not all(k.startswith("--") and "." in k for k in rest[::2]):
        raise SystemExit(f"overrides must be pairs like --model.n_layers 6, got {rest}")
    return {k[2:]: v for k, v in zip(rest[::2], rest[1::2])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument("--settings", default="", help="comma-separated; default: every setting")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="", help="directory for one JSON per setting and table.txt")
    p.add_argument("--predict-only", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="with --predict-only: what each phase holds")
    p.add_argument("--device", default="cuda", help="cpu only checks that the script runs")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child process: one setting
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    overrides = _split_overrides(rest)

    if args.one:
        cfg = build_config(args.config, overrides, args.one)
        result = {"setting": args.one, **run_one(cfg, args.steps, args.warmup, args.device),
                  **predicted_phases(cfg)}
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return

    base = build_config(args.config, overrides, "fp32")
    settings = args.settings.split(",") if args.settings else default_settings(base)
    out = Path(args.out or f"/tmp/moefold-memory-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for setting in settings:
        cfg = build_config(args.config, overrides, setting)
        rows[setting] = predicted_phases(cfg)
        if not args.predict_only:
            rows[setting].update(run_setting_in_subprocess(args, rest, setting, out))
            rows[setting].update(predicted_phases(cfg))
            print(f"{setting}: {rows[setting]}", flush=True)
    if args.predict_only:
        print(f"{'setting':28s} {'peak':>8s} {'fwd':>8s} {'bwd':>8s} {'optim':>8s}  (predicted GiB)")
        for setting, r in rows.items():
            print(f"{setting:28s} {r['predicted_gib']:8.2f} {r['predicted_forward_gib']:8.2f} "
                  f"{r['predicted_backward_gib']:8.2f} {r['predicted_optimizer_gib']:8.2f}")
            if args.breakdown:
                for phase, parts in r["predicted_parts_gib"].items():
                    print(f"    {phase:15s} " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v))
                print("    activations     " + ", ".join(
                    f"{k} {v:.2f}" for k, v in r["predicted_activations_gib"].items() if v))
        return
    table = format_table(rows)
    (out / "table.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
