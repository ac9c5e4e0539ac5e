"""One optimizer step of PrecisionAwareAdamW over a model's parameters, per state precision and path.

Builds the preset's model on the meta device, gives each parameter a CUDA tensor and a random
gradient, and times `step()` (CUDA events, after warm-up steps) for each row: master weights,
moment dtypes, and the path — `fused` (one Triton kernel pass per parameter, optim/fused.py) or
`foreach` (torch._foreach ops, fp32 working copies). Prints ms per step, the state bytes one step
reads and writes per parameter, and the bandwidth that implies. One GPU; run from the repository:

    export PYTHONPATH=$PWD/src
    python3 benchmarks/adamw_step.py [--config qwen3-30b-a3b] [--set model.n_layers=6] [--steps 5] \\
        [--rows bf16+remainder:fp32:fused,bf16+remainder:fp8:foreach,bf16+remainder:fp8:fused]

A row is MASTER:MOMENTS:PATH, MOMENTS one dtype for both or EXP_AVG/EXP_AVG_SQ (e.g. fp8/bf16).
Gradients are in the parameters' dtype, as training makes them: bf16 with bf16 masters, fp32 with
fp32 ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from moefold.config import load_config  # noqa: E402
from moefold.models.transformer import build_model  # noqa: E402
from moefold.optim.precision import PrecisionAwareAdamW  # noqa: E402

DEFAULT_ROWS = ("bf16+remainder:fp32:fused,bf16+remainder:bf16:fused,bf16+remainder:fp8:foreach,"
                "bf16+remainder:fp8:fused")
BYTES = {"fp32": 4, "bf16": 2, "fp8": 1 + 4 / 128}  # an fp8 moment carries a scale per 128
MASTER_BYTES = {"fp32": 4, "bf16": 2, "bf16+remainder": 4}


def time_row(row: str, shapes: list[torch.Size], steps: int, warmup: int):
    master, moments, path = row.split(":")
    exp_avg, _, exp_avg_sq = moments.partition("/")
    exp_avg_sq = exp_avg_sq or exp_avg
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda") * 0.02) for shape in shapes]
    opt = PrecisionAwareAdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, master=master,
                              exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq, fused=path == "fused",
                              foreach=path == "foreach")
    for p in params:  # after the optimizer made bf16-master parameters bf16
        p.grad = torch.randn(p.shape, device="cuda", dtype=p.dtype) * 1e-3
    grad_bytes = params[0].element_size()
    for _ in range(warmup):
        opt.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    n = sum(p.numel() for p in params)
    per_param = 2 * (MASTER_BYTES[master] + BYTES[exp_avg] + BYTES[exp_avg_sq]) + grad_bytes
    del opt, params
    torch.cuda.empty_cache()
    return ms, n, per_param


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--set", action="append", default=["model.n_layers=6"], metavar="KEY=VALUE")
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    cfg = load_config(args.config, overrides)
    with torch.device("meta"):
        shapes = [p.shape for p in build_model(cfg, cfg.model.vocab_size).parameters()]
    print(f"{args.config} {overrides}: {sum(s.numel() for s in shapes) / 1e9:.2f}B parameters in "
          f"{len(shapes)} tensors, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| master:moments:path | ms per step | state bytes per parameter (read + write) | GB/s |")
    print("|---|---|---|---|")
    for row in args.rows.split(","):
        ms, n, per_param = time_row(row, shapes, args.steps, args.warmup)
        print(f"| {row} | {ms:.2f} | {per_param:.2f} | {n * per_param / ms / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
