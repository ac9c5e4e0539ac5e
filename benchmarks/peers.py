"""moefold against its peers in one run: the same shape, batch and random tokens, one table.

Systems (../shared/design/PEERS.md): TorchTitan 0.2.2 eager, compiled by its own `apply_compile`
and compiled per whole block (model classes built directly, `init_weights` under no_grad), compiled
with FP8 as its two torchao converters set it up (`torchtitan-compile-fp8`: rowwise FP8 linears but
the output head and routers, rowwise FP8 grouped GEMMs for the routed experts; torchao 0.18), Hugging
Face transformers with grouped_mm experts, and moefold eager, with `train.compile`, and compiled
with the precision-aware optimizer ("lean", MOEFOLD_SYSTEMS), each the Trainer's own step as
`moefold bench` runs it. Every system trains with bf16 autocast, grad-norm clipping at 1.0,
micro-batch 4 × sequence 4096 of uniform random tokens, dropless routing with force-balancing off;
all but "lean" over fp32 weights with fused AdamW. Throughput is by
one FLOP count for all: `moefold.train.flops.train_flops_per_token` of the moefold model of the same
shape (Megatron's convention); each peer's parameter count is printed beside moefold's to show the
shapes agree. A library that does not import gives a "skipped: ... not installed" row.

Every row runs in a fresh Python process (`run_isolated`), rows side by side on the visible GPUs, one
per GPU: no row inherits another system's process-wide settings, allocator pools or compile caches.

    export PYTHONPATH=$PWD/src            # plus the carried wheels' site dir (PEERS.md; torchao too for FP8)
    python3 benchmarks/peers.py [--shapes qwen3-30b-a3b-6l,deepseek-v3-small-8l] \
        [--systems torchtitan,torchtitan-compile,torchtitan-compile-blocks,torchtitan-compile-fp8,transformers,moefold,moefold-compile,moefold-compile-lean] \
        [--steps 10] [--warmup 3] [--repeats 1] [--gpus N] [--timeout S] \
        [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from moefold.bench.timing import alloc_retries, measured_peak_tflops, time_steps
from moefold.config import Config, load_config
from moefold.optim.adamw import param_groups
from moefold.train.flops import count_params, meta_model, train_flops_per_token
from moefold.train.loss import cross_entropy_loss

# The two benchmark shapes of issue 7, as moefold configs; the peers are built from the same config.
SHAPES = {
    "qwen3-30b-a3b-6l": ("qwen3-30b-a3b", {"model.n_layers": "6"}),
    # DeepSeek-V2-Lite dimensions (MLA without q-LoRA, 64 experts top-6 + 2 shared, first layer
    # dense) with DeepSeek-V3's sigmoid routing and top-k renormalisation; transformers' DeepSeek-V3
    # always has the (zero) selection bias, so moefold carries it too.
    "deepseek-v3-small-8l": ("deepseek-v2-lite", {
        "model.family": "deepseek_v3", "model.n_layers": "8", "moe.score_func": "sigmoid",
        "moe.norm_topk_prob": "true", "moe.expert_bias": "true"}),
    # A seconds-long CPU run of the harness itself (tests); not a benchmark shape.
    "tiny-qwen3": ("tiny-qwen3", {"train.micro_batch_size": "2", "train.seq_len": "64"}),
}
BENCHMARK_SHAPES = ("qwen3-30b-a3b-6l", "deepseek-v3-small-8l")  # issue 7's; the default
COMMON = {"train.micro_batch_size": "4", "train.seq_len": "4096", "moe.force_balanced": "false"}
# moefold's rows: the shape's config plus these overrides. "lean" is Megatron-Core's
# precision-aware optimizer: bf16 parameters with int16 remainders that keep the exact fp32 master,
# bf16 gradients (what the bf16 GEMMs produce; one micro-batch accumulates nothing), fp32 moments,
# one fused Triton update on CUDA; no fp32→bf16 weight casts in the step.
MOEFOLD_SYSTEMS = {
    "moefold": {},
    "moefold-compile": {"train.compile": "true"},
    "moefold-compile-lean": {"train.compile": "true", "optim.master_dtype": "bf16+remainder",
                             "optim.grad_dtype": "bf16"},
}
SYSTEMS = ("torchtitan", "torchtitan-compile", "torchtitan-compile-blocks", "torchtitan-compile-fp8",
           "transformers", *MOEFOLD_SYSTEMS)
REFERENCE = "torchtitan-compile"  # the ratio column: moefold's best TFLOP/s over each system's


class Skipped(Exception):
    """A system that cannot run here (library missing, shape not expressible): one table row."""


@dataclasses.dataclass
class Peer:
    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]  # input ids [B, S] → logits [B, S, V]
    note: str = ""


# ------------------------------------------------------------------------------------ builders


def build_torchtitan(cfg: Config, device: torch.device, compile_mode: str | None, fp8: bool = False) -> Peer:
    """compile_mode: None (eager), "apply_compile" (TorchTitan's own: each block's attention, norms
    and MoE routing compiled, the routed experts left eager) or "blocks" (whole blocks, experts
    included, as PEERS.md's "torch.compile per block" figures were measured). fp8: converted to
    rowwise FP8 training before compiling, as TorchTitan's converters do (`_convert_to_fp8`)."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.moe import MoEArgs
    except ImportError as e:
        raise Skipped(f"torchtitan not installed ({e})") from None
    m, moe = cfg.model, cfg.moe
    moe_args = MoEArgs(num_experts=moe.num_experts, num_shared_experts=moe.shared_experts,
                       top_k=moe.top_k, score_func=moe.score_func, route_norm=moe.norm_topk_prob,
                       route_scale=moe.routed_scaling_factor, score_before_experts=False)
    _set_if_present(moe_args, _debug_force_load_balance=False, use_grouped_mm=True)
    if m.attention == "mla":
        from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
        from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model

        args = DeepSeekV3ModelArgs(
            vocab_size=m.vocab_size, dim=m.dim, inter_dim=m.ffn_hidden, moe_inter_dim=moe.expert_hidden,
            n_layers=m.n_layers, n_dense_layers=moe.first_k_dense, n_heads=m.n_heads, moe_args=moe_args,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, max_seq_len=cfg.train.seq_len)
        args.moe_impl = "standard"  # PEERS.md: the plain (non-DeepEP) MoE of 0.2.2
        model_cls = DeepSeekV3Model
    else:
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model

        args = Qwen3ModelArgs(
            vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_dim=m.ffn_hidden, qk_norm=m.qk_norm,
            rope_theta=m.rope_theta, norm_eps=m.norm_eps, max_seq_len=cfg.train.seq_len,
            moe_enabled=True, moe_inter_dim=moe.expert_hidden, moe_args=moe_args)
        model_cls = Qwen3Model
    # SDPA with a causal mask in every version (0.2.x: use_flex_attn; later: attn_type)
    _set_if_present(args, use_flex_attn=False, attn_type="sdpa", attn_mask_type="causal")
    with torch.device(device):
        model = model_cls(args)
    with torch.no_grad():
        try:
            model.init_weights(buffer_device=device)
        except TypeError:
            model.init_weights()
    notes = [_convert_to_fp8(model)] if fp8 else []  # before compiling, as TorchTitan orders them
    if compile_mode is not None:
        compile_model = {"apply_compile": _apply_compile, "blocks": _compile_whole_blocks}[compile_mode]
        notes.append(compile_model(model))
    return Peer(model, lambda ids: model(ids), ", ".join(notes))


def _convert_to_fp8(model: nn.Module) -> str:
    """What TorchTitan's `quantize.linear.float8` (recipe "rowwise", filter_fqns ["output",
    "router.gate"], its recommendation for MoE models) and `quantize.grouped_mm.float8` (fqns
    ["experts"]) converters do, called directly: 0.2.2's grouped-GEMM converter imports
    `MoETrainingConfig`, which torchao 0.18 calls `Float8TrainingOpConfig`."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m
    except ImportError as e:
        raise Skipped(f"torchao FP8 training not installed ({e})") from None

    def linear_filter(module: nn.Module, fqn: str) -> bool:  # TorchTitan's module_filter_fn
        return (isinstance(module, nn.Linear) and all(d % 16 == 0 for d in module.weight.shape)
                and not any(skip in fqn for skip in ("output", "router.gate")))

    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True  # TorchTitan sets it for rowwise
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=linear_filter)
    set_token_group_alignment_size_m(16)  # FP8 grouped GEMMs need groups of 16 rows
    quantize_(model, config=Float8TrainingOpConfig(),
              filter_fn=lambda module, fqn: fqn.endswith("moe.experts"))  # not shared_experts
    return "rowwise FP8 (torchao): linears but output and router.gate, routed experts"


def _apply_compile(model: nn.Module) -> str:
    """TorchTitan's own compile (what `--compile.enable` runs)."""
    try:
        from torchtitan.models.llama4.infra.parallelize import apply_compile

        apply_compile(model, SimpleNamespace(enable=True, backend="inductor", components=["model"]),
                      ep_enabled=False)
        return "torchtitan apply_compile"
    except Exception as e:  # another version's signature: compile whole blocks instead
        return _compile_whole_blocks(model) + f" (apply_compile: {type(e).__name__})"


def _compile_whole_blocks(model: nn.Module) -> str:
    torch._dynamo.config.capture_scalar_outputs = True
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=False))
    return "torch.compile per whole block"


def build_transformers(cfg: Config, device: torch.device) -> Peer:
    try:
        import transformers
    except ImportError as e:
        raise Skipped(f"transformers not installed ({e})") from None
    from moefold.checkpoint.hf import hf_config_from
    from moefold.errors import UserError

    try:
        hf = hf_config_from(cfg, cfg.model.vocab_size)
    except UserError as e:
        raise Skipped(f"shape not expressible in transformers: {e}") from None
    hf.pop("architectures")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **{**hf, "use_cache": False})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa", experts_implementation="grouped_mm")
    model.train()
    return Peer(model, lambda ids: model(input_ids=ids, use_cache=False).logits,
                f"transformers {transformers.__version__}")


def _set_if_present(obj, **values) -> None:
    for name, value in values.items():
        if hasattr(obj, name):
            setattr(obj, name, value)


# ------------------------------------------------------------------------------------ timing


def time_peer(peer: Peer, cfg: Config, device: torch.device, steps: int, warmup: int) -> dict:
    """The training step every peer runs: autocast forward, fp32-logit cross-entropy, backward,
    clip at 1.0, fused AdamW (moefold's parameter groups), zero_grad."""
    t = cfg.train
    params = [p for p in peer.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(peer.model, t.weight_decay), lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps, fused=device.type == "cuda")
    gen = torch.Generator(device).manual_seed(0)
    B, S, V = t.micro_batch_size, t.seq_len, cfg.model.vocab_size

    def step():
        ids_BS1 = torch.randint(0, V, (B, S + 1), device=device, generator=gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = cross_entropy_loss(peer.forward(ids_BS1[:, :-1]), ids_BS1[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step_s, loss = time_steps(step, device, steps, warmup)
    cuda = device.type == "cuda"
    return {"step_s": step_s, "loss": float(loss.detach()), "params": sum(p.numel() for p in params),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "alloc_retries": alloc_retries(device)}


def run_system(system: str, cfg: Config, device: torch.device, steps: int, warmup: int) -> dict:
    if system in MOEFOLD_SYSTEMS:
        from moefold.bench.run import run_bench

        r = run_bench(cfg, steps, warmup).record
        note = ", ".join([r["compute_dtype"], *(f"{k}={v}" for k, v in MOEFOLD_SYSTEMS[system].items()
                                                  if k != "train.compile")])
        return {"seconds": r["seconds"], "step_ms": r["step_ms_mean"], "step_ms_each": r["step_ms"],
                "params": r["params_total"], "peak_gib": r["peak_mem_gib"], "loss": r["loss"],
                "alloc_retries": r["alloc_retries"], "note": note}
    builders = {"torchtitan": lambda: build_torchtitan(cfg, device, None),
                "torchtitan-compile": lambda: build_torchtitan(cfg, device, "apply_compile"),
                "torchtitan-compile-blocks": lambda: build_torchtitan(cfg, device, "blocks"),
                "torchtitan-compile-fp8": lambda: build_torchtitan(cfg, device, "apply_compile", fp8=True),
                "transformers": lambda: build_transformers(cfg, device)}
    peer = builders[system]()
    r = time_peer(peer, cfg, device, steps, warmup)
    return {"seconds": sum(r["step_s"]), "step_ms": 1e3 * statistics.fmean(r["step_s"]),
            "step_ms_each": [1e3 * s for s in r["step_s"]], "params": r["params"],
            "peak_gib": r["peak_gib"], "loss": r["loss"], "alloc_retries": r["alloc_retries"],
            "note": peer.note}


def shape_config(shape: str, device_type: str, system: str = "") -> Config:
    preset, overrides = SHAPES[shape]
    return load_config(preset, {**COMMON, **overrides, **MOEFOLD_SYSTEMS.get(system, {}),
                                "train.device": device_type})


def run_one(shape: str, system: str, device: torch.device, steps: int, warmup: int) -> dict:
    """One row, in this (fresh) process: the system's timing, or why it was skipped."""
    try:
        return run_system(system, shape_config(shape, device.type, system), device, steps, warmup)
    except Skipped as e:
        return {"skipped": str(e)}
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    except Exception as e:  # a peer's failure must not cost the other rows of the run
        traceback.print_exc()
        return {"skipped": f"failed: {type(e).__name__}: {str(e)[:200]}"}


def run_isolated(jobs: list[tuple[str, str]], args: argparse.Namespace) -> dict[tuple[str, str], list[dict]]:
    """Each (shape, system) run in its own Python process, one per GPU at a time over `args.gpus`
    GPUs; every row `args.repeats` times, the repeats interleaved with the other rows.

    A row timed after other systems in the same process measured their leftovers: moefold compiled
    ran DeepSeek-V3-small at 419.6 ms after TorchTitan compiled, 252.8 ms alone (same commit, same
    H200). Not Dynamo's capture_scalar_outputs, which TorchTitan's compile sets process-wide
    (moefold alone with it on: 255.8 ms); the leftover was not pinned down further (allocator
    pools, compile caches and global settings all carry over). A fresh process per row measures each
    system as its users run it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    slots = visible.split(",")[:args.gpus] if visible else [str(i) for i in range(args.gpus)]
    pending = [(shape, system, k) for k in range(args.repeats) for shape, system in jobs]
    running, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            for slot in [s for s in slots if s not in running]:
                if not pending:
                    break
                shape, system, k = pending.pop(0)
                out = Path(tmp) / f"{shape}.{system}.{k}.json"
                cmd = [sys.executable, __file__, "--one", shape, system, str(out), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--device", args.device]
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": slot} if args.device == "cuda" else None
                running[slot] = (shape, system, out, subprocess.Popen(cmd, env=env), time.monotonic())
            time.sleep(0.5)
            for slot, (shape, system, out, proc, t0) in list(running.items()):
                if proc.poll() is None and time.monotonic() - t0 < args.timeout:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                row = json.loads(out.read_text()) if out.exists() else {
                    "skipped": f"process ended with {proc.returncode} (timeout {args.timeout:.0f} s)"}
                rows.setdefault((shape, system), []).append(row)
                print(f"{shape} {system}: {row}", file=sys.stderr, flush=True)
                del running[slot]
    return rows


def merge_repeats(runs: list[dict]) -> dict:
    """One row from a system's repeats: all their timed steps together (throughput = tokens over
    time of all of them), each repeat's mean step time kept; skipped when no repeat was timed."""
    timed = [r for r in runs if "skipped" not in r]
    if not timed:
        return runs[0]
    row = {**timed[-1], "seconds": sum(r["seconds"] for r in timed),
           "step_ms_each": [ms for r in timed for ms in r["step_ms_each"]],
           "peak_gib": max((r["peak_gib"] for r in timed if r["peak_gib"] is not None), default=None),
           "alloc_retries": None if timed[-1]["alloc_retries"] is None else sum(r["alloc_retries"] for r in timed),
           "repeat_step_ms": [r["step_ms"] for r in timed]}
    row["step_ms"] = statistics.fmean(row["step_ms_each"])
    if len(timed) < len(runs):
        row["note"] = f"{row['note']} ({len(runs) - len(timed)} of {len(runs)} repeats failed)".strip()
    return row


def shape_result(shape: str, systems: list[str], rows: dict[tuple[str, str], list[dict]]) -> dict:
    """A shape's table: each row's throughput by the one FLOP count of the moefold model."""
    preset, overrides = SHAPES[shape]
    cfg = shape_config(shape, "cpu")
    model = meta_model(cfg)
    flops_per_token = train_flops_per_token(model, cfg.train.seq_len)  # one count for every system
    ours = count_params(model).main_total  # as bench's params_total: MTP modules apart
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.seq_len
    table = {}
    for system in systems:
        r = merge_repeats(rows[shape, system])
        if "skipped" not in r:
            tokens_per_s = tokens_per_step * len(r["step_ms_each"]) / r["seconds"]
            r = {**r, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
                 "params_vs_moefold": r["params"] / ours}
        table[system] = r
    return {"shape": shape, "preset": preset, "overrides": {**COMMON, **overrides},
            "flops_per_token": flops_per_token, "params": ours, "rows": table}


def format_shape(result: dict) -> str:
    rows = result["rows"]
    ref = max((rows.get(s, {}).get("tflops") or 0 for s in MOEFOLD_SYSTEMS), default=0)
    head = (f"{'system':22s} {'tok/s':>9s} {'TFLOP/s':>8s} {'peak GiB':>8s} {'step ms':>8s} "
            f"{'min-max':>13s} {'retries':>7s} {'params/ours':>11s} {'moefold ×':>9s}  note")
    lines = [f"{result['shape']} ({result['preset']} + {result['overrides']}), "
             f"{result['flops_per_token'] / 1e9:.3f} GFLOP per token", head]
    for system, r in rows.items():
        if "skipped" in r:
            lines.append(f"{system:22s} skipped: {r['skipped']}")
            continue
        ratio = f"{ref / r['tflops']:9.2f}" if ref else f"{'-':>9s}"
        peak = f"{r['peak_gib']:8.1f}" if r["peak_gib"] is not None else f"{'-':>8s}"
        spread = f"{min(r['step_ms_each']):.0f}-{max(r['step_ms_each']):.0f}"
        retries = "-" if r["alloc_retries"] is None else str(r["alloc_retries"])
        repeats = r.get("repeat_step_ms", [])
        note = r["note"] + (f" (repeats: {'/'.join(f'{ms:.1f}' for ms in repeats)} ms)" if len(repeats) > 1 else "")
        lines.append(f"{system:22s} {r['tokens_per_s']:9,.0f} {r['tflops']:8.1f} {peak} "
                     f"{r['step_ms']:8.1f} {spread:>13s} {retries:>7s} {r['params_vs_moefold']:11.4f} "
                     f"{ratio}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(BENCHMARK_SHAPES))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--gpus", type=int, default=None,
                   help="rows run side by side, one per GPU (default: every visible GPU)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one row may take")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times, each in a fresh process (one table row)")
    p.add_argument("--json", type=Path)
    p.add_argument("--one", nargs=3, metavar=("SHAPE", "SYSTEM", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:  # a child process: one row, written as JSON
        shape, system, out = args.one
        device = torch.device(args.device)
        row = {**run_one(shape, system, device, args.steps, args.warmup),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "peak_tflops_measured": measured_peak_tflops(device)}
        Path(out).write_text(json.dumps(row))
        return 0
    shapes, systems = args.shapes.split(","), args.systems.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"peers.py: unknown {unknown}; shapes: {list(SHAPES)}, systems: {list(SYSTEMS)}",
              file=sys.stderr)
        return 2
    if args.repeats < 1 or args.steps < 1:
        print(f"peers.py: --repeats {args.repeats} and --steps {args.steps} must be >= 1", file=sys.stderr)
        return 2
    if args.gpus is None:
        args.gpus = max(torch.cuda.device_count(), 1) if args.device == "cuda" else 1
    rows = run_isolated([(s, system) for s in shapes for system in systems], args)
    results = [shape_result(s, systems, rows) for s in shapes]
    timed = [r for runs in rows.values() for r in runs if "skipped" not in r]
    name = timed[0]["device"] if timed else args.device
    peaks = sorted(round(r["peak_tflops_measured"]) for r in timed if r["peak_tflops_measured"])
    print(f"{name}, torch {torch.__version__}, measured bf16 peak "
          + (f"{peaks[0]}-{peaks[-1]} TFLOP/s over the rows" if peaks else "-")
          + f"; {args.steps} steps after {args.warmup} × {args.repeats} repeat(s), one process per "
          + f"run on {args.gpus} "
          + ("GPU(s)" if args.device == "cuda" else "CPU"))
    for result in results:
        print(format_shape(result))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "gpus": args.gpus,
                                         "peak_tflops_measured": peaks, "shapes": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
