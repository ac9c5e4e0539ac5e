"""The quantization around the rowwise FP8 grouped GEMMs alone, compiled, torch (Inductor) against
the Triton column quantizers (fp8/triton_quant.py): ms and GB/s over the fewest bytes the operation
must move (bf16 read + FP8 write), with a bf16 copy of the same tensors as the bandwidth yardstick.
Each call's device work is timed, replayed from a CUDA graph (the host's launch cost does not
count, as in a compiled step whose host runs ahead of the GPU).

Default shape: Qwen3-30B-A3B's experts at micro-batch 4 × 4096 (R = 131,072 routed rows, balanced
over E = 128 experts, K = 2048, F = 768). Needs a CUDA GPU with Triton.

    PYTHONPATH=src python benchmarks/fp8_quant.py [--rows 131072] [--experts 128] [--dim 2048] [--hidden 768]
"""

from __future__ import annotations

import argparse
import sys

import torch

from moefold.bench.timing import graph_median_seconds
from moefold.fp8.grouped import (
    TorchColumnQuantizer,
    TritonColumnQuantizer,
    contract_operands,
    grouped_scaling,
    quantize_group_columns,
    rows_operands,
)
from moefold.fp8.recipes import Operand, quantize


def timed(name: str, fn, nbytes: int, device: torch.device) -> None:
    torch._dynamo.reset()
    ms = 1e3 * graph_median_seconds(torch.compile(fn), device, repeats=20)
    print(f"{name:42s} {ms:8.3f} {nbytes / ms / 1e6:8.0f} {nbytes / 1e9:8.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_quant.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    R, E, K, F = args.rows, args.experts, args.dim, args.hidden
    s, col = grouped_scaling("rowwise"), Operand("col")
    x_RK = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    g_RF = torch.randn(R, F, device=dev, dtype=torch.bfloat16)
    w1_EKF = torch.randn(E, K, F, device=dev, dtype=torch.bfloat16) * 0.02
    w2_EFK = torch.randn(E, F, K, device=dev, dtype=torch.bfloat16) * 0.02
    offsets_E = (torch.arange(1, E + 1, device=dev) * (R // E)).to(torch.int32)
    torch_q, triton_q = TorchColumnQuantizer(), TritonColumnQuantizer()
    x_bytes, g_bytes, w_bytes = (3 * t.numel() for t in (x_RK, g_RF, w1_EKF))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; R={R}, E={E}, K={K}, F={F}")
    print(f"{'operation (compiled)':42s} {'ms':>8s} {'GB/s':>8s} {'min GB':>8s}")
    rows = [
        ("bf16 copy of w1 (yardstick)", lambda: w1_EKF.clone(), 4 * w1_EKF.numel()),
        ("bf16 copy of x (yardstick)", lambda: x_RK.clone(), 4 * x_RK.numel()),
        ("x per row (torch, as training)", lambda: quantize(x_RK, s.forward.a), x_bytes),
        ("w1 per column, layout: torch", lambda: torch_q.weight(w1_EKF, col), w_bytes),
        ("w1 per column, layout: triton", lambda: triton_q.weight(w1_EKF, col), w_bytes),
        ("w1^T per column (grad_input): torch", lambda: torch_q.weight(w1_EKF.transpose(-2, -1), col), w_bytes),
        ("w1^T per column (grad_input): triton", lambda: triton_q.weight(w1_EKF.transpose(-2, -1), col), w_bytes),
        ("w2 per column, layout: triton", lambda: triton_q.weight(w2_EFK, col), w_bytes),
        ("w2^T per column (grad_input): triton", lambda: triton_q.weight(w2_EFK.transpose(-2, -1), col), w_bytes),
        ("rows_operands(x, w1): torch", lambda: rows_operands(x_RK, w1_EKF, s.forward), x_bytes + w_bytes),
        ("x group columns, no transpose: torch", lambda: quantize_group_columns(x_RK, offsets_E, col), x_bytes),
        ("x group columns, transposed: triton", lambda: triton_q.group_columns_t(x_RK, offsets_E, col), x_bytes),
        ("grad group columns, transposed: torch", lambda: torch_q.group_columns_t(g_RF, offsets_E, col), g_bytes),
        ("grad group columns, transposed: triton", lambda: triton_q.group_columns_t(g_RF, offsets_E, col), g_bytes),
        ("contract_operands(x, grad): torch",
         lambda: contract_operands(x_RK, g_RF, offsets_E, s.grad_weight, torch_q), x_bytes + g_bytes),
        ("contract_operands(x, grad): triton",
         lambda: contract_operands(x_RK, g_RF, offsets_E, s.grad_weight, triton_q), x_bytes + g_bytes),
    ]
    for name, fn, nbytes in rows:
        timed(name, fn, nbytes, dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
