"""Weak scaling of expert parallelism: the same per-GPU batch on 1, 2, 4, 8 GPUs with EP = GPUs.

    python benchmarks/weak_scaling.py [--ep 1 2 4 8] [--config qwen3-30b-a3b] [--layers 6] \\
        [--micro-batch 4] [--seq-len 4096] [--steps 10] [--warmup 3] [--out DIR] [-- OVERRIDES...]

Each point is one `moefold bench --profile` under torchrun (one process per GPU, NCCL), EP over all
its GPUs and FSDP over the same GPUs for the dense part (dp = GPUs, edp = 1); tokens per GPU stay
fixed. The table gives tokens/s and TFLOP/s per GPU, their ratio to EP=1, the NCCL time per step
and the part of it no compute kernel overlaps (exposed), for all communication and for the expert
all-to-all alone (from rank 0's profile). Points needing more GPUs than are visible are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def bench_point(ep: int, args: argparse.Namespace, out: Path) -> dict | None:
    record = out / f"ep{ep}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ep),
               "-m", "moefold", "bench", "--config", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--json", str(record), "--profile", str(out / f"ep{ep}-profile"),
               "--model.n_layers", str(args.layers), "--train.micro_batch_size", str(args.micro_batch),
               "--train.seq_len", str(args.seq_len), "--parallel.ep", str(ep), *args.overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, env=env, text=True, capture_output=True)
    (out / f"ep{ep}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"EP={ep}: failed (exit {done.returncode}); log: {out / f'ep{ep}.log'}\n"
              + (done.stdout + done.stderr)[-3000:], file=sys.stderr)
        return None
    return json.loads(record.read_text())


def table(records: dict[int, dict]) -> str:
    base = records.get(1)
    head = (f"{'GPUs=EP':>7s} {'step ms':>8s} {'tok/s/GPU':>10s} {'TFLOP/s/GPU':>11s} {'vs EP1':>6s} "
            f"{'NCCL ms':>8s} {'exposed':>8s} {'a2a ms':>7s} {'a2a exp':>8s} {'a2a exp %':>9s} {'peak GiB':>8s}")
    lines = [head]
    for ep, r in sorted(records.items()):
        p = r.get("profile", {})
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:6.3f}" if base else f"{'-':>6s}"
        a2a_share = 100 * p.get("all_to_all_exposed_ms", 0.0) / p["step_ms"] if p else 0.0
        lines.append(f"{ep:7d} {r['step_ms_mean']:8.1f} {r['tokens_per_s']:10,.0f} {r['tflops']:11.1f} {ratio} "
                     f"{p.get('comm_busy_ms', 0.0):8.2f} {p.get('comm_exposed_ms', 0.0):8.2f} "
                     f"{p.get('all_to_all_ms', 0.0):7.2f} {p.get('all_to_all_exposed_ms', 0.0):8.2f} "
                     f"{a2a_share:8.1f}% {r['peak_mem_gib']:8.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("weak-scaling"))
    parser.add_argument("overrides", nargs="*", help="after --: more moefold options (--key value)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    records = {}
    for ep in args.ep:
        if gpus and ep > gpus:  # (on a CPU machine the ranks run on gloo: a smoke run)
            print(f"EP={ep}: skipped ({gpus} GPUs visible)")
            continue
        record = bench_point(ep, args, args.out)
        if record is not None:
            records[ep] = record
    if not records:
        sys.exit(1)
    r = next(iter(records.values()))
    print(f"weak scaling, {args.config} {args.layers} layers, {args.micro_batch} × {args.seq_len} tokens "
          f"per GPU, {r['device']}, torch {r['torch']}, commit {r['commit']}, {r['date']}")
    print(table(records))
    (args.out / "weak_scaling.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
