"""The routed experts' grouped GEMMs alone, bf16 against FP8 rowwise, one row per GEMM kind.

Written when issue 8's FP8 step was slower than bf16 because `torch._scaled_grouped_mm` took 96 ms
of the Qwen3-30B-A3B-6L step where bf16's grouped GEMMs take about 34 (docs/fp8.md). This script
says how fast each of the three GEMMs is, and how much the quantization around them adds:

  forward      x_RK · w_EKN            (2d × 3d, groups along the rows)
  grad_input   grad_RN · w_ENK         (2d × 3d, the transposed weight)
  grad_weight  x_eᵀ · grad_e per group  (2d × 2d, groups along the contraction)

Columns "kernel": the GEMM alone, on operands already in the layout and dtype it reads (FP8 scales
precomputed), for torch's CUTLASS kernel and moefold's Triton one (`precision.fp8_grouped_gemm`),
rowwise, and moefold's blockwise Triton kernels (DeepSeek-V3's scales; no torch kernel exists).
Columns "+quant": `moefold.fp8.grouped`'s backend call as training makes it (amax, scale, cast and
layout copies included). Balanced routing: R = T·K rows, R/E per expert.
Timing: each call's device work, replayed from a CUDA graph (`--timing graph`, the default: the
host's launch cost does not count, as in a compiled step whose host runs ahead of the GPU), or
each call as issued eagerly (`--timing eager`: the Triton ops' host-side launch, 0.1-0.4 ms on
the H200's host, then shows up as idle device time, up to doubling their apparent time).
Needs a CUDA GPU with FP8 (sm90).

    PYTHONPATH=src python benchmarks/fp8_grouped.py [--tokens 16384] [--top-k 8] [--experts 128] \
        [--dim 2048] [--hidden 768] [--timing graph|eager] [--sweep]
"""

from __future__ import annotations

import argparse
import sys

import torch

from moefold.bench.limit import balanced_rows
from moefold.bench.timing import graph_median_seconds, median_seconds
from moefold.fp8.grouped import (
    ScaledGroupedMMFp8Gemm,
    TritonBlockwiseFp8GroupedGemm,
    TritonFp8GroupedGemm,
    blockwise_contract_operands,
    blockwise_rows_operands,
    contract_operands,
    grouped_scaling,
    rows_operands,
)
from moefold.fp8.triton_grouped import HAS_TRITON


TIMERS = {"graph": graph_median_seconds, "eager": median_seconds}


def operands(routed: int, E: int, K: int, N: int, device: torch.device):
    """x, grad, w and the groups' row ends; each group padded to 128 rows, as the FP8 layer pads
    for blockwise (a multiple of rowwise's 16; the default shapes need no padding)."""
    rows_E = balanced_rows(routed, E, pad_multiple=128)
    R = int(rows_E.sum())
    g = torch.Generator(device=device).manual_seed(0)
    x_RK = torch.randn(R, K, device=device, dtype=torch.bfloat16, generator=g)
    grad_RN = torch.randn(R, N, device=device, dtype=torch.bfloat16, generator=g)
    w_EKN = torch.randn(E, K, N, device=device, dtype=torch.bfloat16, generator=g) * 0.02
    offsets_E = rows_E.to(device).cumsum(0).to(torch.int32)
    return x_RK, grad_RN, w_EKN, offsets_E


def bf16_calls(x_RK, grad_RN, w_EKN, offsets_E) -> dict:
    w_ENK = w_EKN.transpose(-2, -1)
    return {"forward": lambda: torch._grouped_mm(x_RK, w_EKN, offs=offsets_E),
            "grad_input": lambda: torch._grouped_mm(grad_RN, w_ENK, offs=offsets_E),
            "grad_weight": lambda: torch._grouped_mm(x_RK.t(), grad_RN, offs=offsets_E)}


def fp8_kernel_calls(x_RK, grad_RN, w_EKN, offsets_E, backend) -> dict:
    """The backend's FP8 GEMMs on operands quantized beforehand, in the layouts its calls make."""
    s = grouped_scaling("rowwise")
    forward = rows_operands(x_RK, w_EKN, s.forward)
    grad_input = rows_operands(grad_RN, w_EKN.transpose(-2, -1), s.grad_input)
    grad_weight = contract_operands(x_RK, grad_RN, offsets_E, s.grad_weight)
    return {"forward": lambda: backend._rows(*forward, offsets_E),
            "grad_input": lambda: backend._rows(*grad_input, offsets_E),
            "grad_weight": lambda: backend._contract(*grad_weight, offsets_E)}


def blockwise_kernel_calls(x_RK, grad_RN, w_EKN, offsets_E) -> dict:
    """The blockwise Triton GEMMs on operands quantized beforehand (1x128, 128x128, 128x1 scales)."""
    s, ops = grouped_scaling("blockwise"), torch.ops.moefold
    forward = blockwise_rows_operands(x_RK, w_EKN, s.forward)
    grad_input = blockwise_rows_operands(grad_RN, w_EKN.transpose(-2, -1), s.grad_input)
    grad_weight = blockwise_contract_operands(x_RK, grad_RN, s.grad_weight)
    return {"forward": lambda: ops.fp8_grouped_mm_rows_blockwise(*forward, offsets_E),
            "grad_input": lambda: ops.fp8_grouped_mm_rows_blockwise(*grad_input, offsets_E),
            "grad_weight": lambda: ops.fp8_grouped_mm_contract_blockwise(*grad_weight, offsets_E)}


def fp8_backend_calls(x_RK, grad_RN, w_EKN, offsets_E, gemm, recipe: str = "rowwise") -> dict:
    """The backend as the experts' autograd Function calls it: quantization included."""
    s = grouped_scaling(recipe)
    bf16 = torch.bfloat16
    return {"forward": lambda: gemm.grouped_mm(x_RK, w_EKN, offsets_E, s.forward, bf16),
            "grad_input": lambda: gemm.grouped_mm(grad_RN, w_EKN.transpose(-2, -1), offsets_E,
                                                  s.grad_input, bf16),
            "grad_weight": lambda: gemm.grouped_weight_grad(x_RK, grad_RN, offsets_E, s.grad_weight, bf16)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768, help="one projection's width (w1, w3 or w2's input)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--timing", choices=("graph", "eager"), default="graph",
                   help="device work replayed from a CUDA graph, or each call as issued eagerly")
    p.add_argument("--sweep", action="store_true",
                   help="also time the Triton kernels over candidate tile configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("fp8_grouped.py: needs a CUDA GPU with FP8 grouped GEMMs (sm90 or newer)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    R, E, K, N = args.tokens * args.top_k, args.experts, args.dim, args.hidden
    tensors = operands(R, E, K, N, device)
    R = tensors[0].shape[0]
    flop = 2 * R * K * N
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; R={R} rows over E={E} experts "
          f"(balanced), K={K}, N={N}: {flop / 1e9:.1f} GFLOP per GEMM")
    backends = {"cutlass": ScaledGroupedMMFp8Gemm()}
    if HAS_TRITON:
        backends["triton"] = TritonFp8GroupedGemm()
    variants = {"bf16": bf16_calls(*tensors)}
    for name, backend in backends.items():
        variants[f"{name} kernel"] = fp8_kernel_calls(*tensors, backend)
        variants[f"{name}+quant"] = fp8_backend_calls(*tensors, backend)
    if HAS_TRITON:
        variants["blockwise kernel"] = blockwise_kernel_calls(*tensors)
        variants["blockwise+quant"] = fp8_backend_calls(*tensors, TritonBlockwiseFp8GroupedGemm(), "blockwise")
    timer = TIMERS[args.timing]
    print(f"{'ms (TFLOP/s)':12s} " + " ".join(f"{name:>16s}" for name in variants) + f"   ({args.timing} timing)")
    for kind in ("forward", "grad_input", "grad_weight"):
        ms = [1e3 * timer(v[kind], device, repeats=args.repeats) for v in variants.values()]
        print(f"{kind:12s} " + " ".join(f"{m:8.3f} ({flop / m / 1e9:5.0f})" for m in ms))
    if args.sweep and HAS_TRITON:
        sweep_tiles(tensors, flop, device, args.repeats, timer)
    return 0


TILE_CANDIDATES = [{"BM": bm, "BN": bn, "BK": bk, "num_warps": w, "num_stages": s}
                   for bm, bn, bk, w, s in [(128, 256, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
                                            (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (64, 256, 128, 4, 4),
                                            (128, 128, 64, 4, 6)]]


def sweep_tiles(tensors, flop: float, device: torch.device, repeats: int, timer) -> None:
    """Each candidate tile configuration of the Triton kernels, kernel-only, one line per config."""
    from triton.runtime.errors import OutOfResources

    from moefold.fp8 import triton_grouped

    calls = fp8_kernel_calls(*tensors, TritonFp8GroupedGemm())
    tables = triton_grouped.ROWS_TILES, triton_grouped.CONTRACT_TILES
    saved = [dict(t) for t in tables]
    print("\nTriton tiles (BM, BN, BK, warps, stages): forward, grad_input, grad_weight ms (TFLOP/s)")
    for tiles in TILE_CANDIDATES:
        for table in tables:
            table.update(tiles)
        cells = []
        for kind in ("forward", "grad_input", "grad_weight"):
            try:
                m = 1e3 * timer(calls[kind], device, repeats=repeats)
                cells.append(f"{m:8.3f} ({flop / m / 1e9:5.0f})")
            except (OutOfResources, RuntimeError) as e:  # over the shared-memory limit: say so, go on
                cells.append(f"{type(e).__name__:>16s}")
        print(f"{tuple(tiles.values())!s:28s} " + " ".join(cells))
    for table, before in zip(tables, saved):
        table.update(before)


if __name__ == "__main__":
    raise SystemExit(main())
