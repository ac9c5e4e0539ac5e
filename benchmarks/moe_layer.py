"""Forward+backward throughput of one MoE layer (default: the Qwen3-30B-A3B layer shape).

Prints one table row per variant: time per forward+backward, TFLOP/s of the expert GEMMs and the
router (6 · T · K · 3 · D · F + 6 · T · D · E: three projections, forward + two backward GEMMs) and
peak memory. Random tokens, random weights, bf16 autocast, dropless.

    PYTHONPATH=src python benchmarks/moe_layer.py [--tokens 16384] [--dim 2048] [--experts 128] ...
"""

import argparse
import dataclasses

import torch

from moefold.config import MoEConfig
from moefold.moe.layer import build_moe_layer


def layer_flops(tokens: int, dim: int, hidden: int, experts: int, top_k: int) -> float:
    return 6 * tokens * top_k * 3 * dim * hidden + 6 * tokens * dim * experts


def time_fwd_bwd(layer, x, grad, iters: int) -> float:
    """Median milliseconds of one forward+backward, timed with CUDA events after warm-up."""
    def step():
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad)

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def print_profile(layer, x, grad) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_fwd_bwd(layer, x, grad, iters=1)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile", action="store_true",
                   help="also print the CUDA kernels of one forward+backward of the first variant")
    args = p.parse_args()

    base = MoEConfig(num_experts=args.experts, top_k=args.top_k, expert_hidden=args.hidden,
                     aux_loss_coeff=0.0)
    variants = {
        "grouped_mm, probs in activation": dataclasses.replace(base, experts_backend="grouped_mm"),
        "grouped_mm, probs at combine": dataclasses.replace(base, experts_backend="grouped_mm",
                                                            memory_efficient_permute=False),
        "grouped_mm, aux loss + pad 16": dataclasses.replace(base, experts_backend="grouped_mm",
                                                             aux_loss_coeff=0.01, pad_multiple=16),
        "loop (per-expert matmuls)": dataclasses.replace(base, experts_backend="loop"),
    }
    flops = layer_flops(args.tokens, args.dim, args.hidden, args.experts, args.top_k)
    print(f"MoE layer T={args.tokens} D={args.dim} E={args.experts} K={args.top_k} F={args.hidden}, "
          f"bf16 autocast, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'variant':36s} {'ms fwd+bwd':>10s} {'TFLOP/s':>8s} {'peak GiB':>8s}")
    for name, cfg in variants.items():
        torch.manual_seed(0)
        layer = build_moe_layer(args.dim, cfg, "cuda", torch.bfloat16).cuda()
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0, 0.02)
        x = torch.randn(args.tokens, args.dim, device="cuda", requires_grad=True)
        grad = torch.randn(args.tokens, args.dim, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        ms = time_fwd_bwd(layer, x, grad, args.iters)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"{name:36s} {ms:10.2f} {flops / ms / 1e9:8.1f} {peak:8.2f}")
        if args.profile:
            print_profile(layer, x, grad)
            args.profile = False
        del layer, x, grad
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
