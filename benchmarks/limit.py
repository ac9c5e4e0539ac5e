"""The step limit: a training step's large kernels timed alone, and their sum.

Output-head GEMMs, core attention (SDPA, GQA or MLA as the model runs it), attention and dense
projections, grouped expert GEMMs with balanced routing (T·K/E rows per expert), the router GEMM and
the optimizer step, each forward + backward in isolation (CUDA events on a GPU, perf_counter on the
CPU); the sum is the time below which no step of this shape can run. `moefold bench --limit`
reports a step against the same sum (src/moefold/bench/limit.py has the details).

    PYTHONPATH=$PWD/src python3 benchmarks/limit.py --config qwen3-30b-a3b --model.n_layers 6 \
        --train.micro_batch_size 4 --train.seq_len 4096 [--repeats 10] [--json PATH] [--no-optimizer]

PEERS.md measured 157 ms (fused fp32 AdamW included) / 122 ms (without) for that shape on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _split_overrides(rest: list[str]) -> dict[str, str]:
    if len(rest) % 2 or not all(k.startswith("--") and "." in k for k in rest[::2]):
        raise SystemExit(f"overrides must be pairs like --model.n_layers 6, got {rest}")
    return {k[2:]: v for k, v in zip(rest[::2], rest[1::2])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-30b-a3b", help="preset name or TOML file")
    p.add_argument("--micro-batch", type=int, default=0, help="train.micro_batch_size (default: the config's)")
    p.add_argument("--seq", type=int, default=0, help="train.seq_len (default: the config's)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per kernel group (median)")
    p.add_argument("--no-optimizer", action="store_true", help="leave the optimizer step out")
    p.add_argument("--json", type=Path, help="write the rows and sums as JSON")
    args, rest = p.parse_known_args(argv)
    overrides = _split_overrides(rest)
    if args.micro_batch:
        overrides["train.micro_batch_size"] = str(args.micro_batch)
    if args.seq:
        overrides["train.seq_len"] = str(args.seq)

    from moefold.bench.limit import format_limit, step_limit
    from moefold.config import load_config
    from moefold.errors import UserError
    from moefold.parallel.launch import resolve_device
    from moefold.train.trainer import resolve_compute_dtype

    try:
        cfg = load_config(args.config, {**overrides, "train.device": args.device})
        device = resolve_device(cfg.train.device)
    except UserError as e:
        print(f"limit.py: error: {e}", file=sys.stderr)
        return 2
    result = step_limit(cfg, device, resolve_compute_dtype(cfg.precision.compute_dtype, device),
                        repeats=args.repeats, optimizer=not args.no_optimizer)
    print(format_limit(result))
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "overrides": overrides, **result},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
