"""Dispatch + combine bandwidth of the expert-parallel dispatchers against a plain all-to-all.

Run on every rank of an EP group (one process per GPU; gloo on CPU for a smoke run):

    torchrun --nproc-per-node 8 benchmarks/dispatch.py [--hidden 7168] [--top-k 8] \\
        [--tokens 4096] [--experts 256] [--repeats 20] [--json PATH]

Each rank routes `--tokens` random tokens of `--hidden` (bf16 on GPU, fp32 on CPU) to top-k of E
experts (uniform random routing, the balanced case), then times, forward only, `dispatch` followed
by `combine` (identity experts) for `alltoall` and `allgather`, and a bare
`all_to_all_single` of the same bytes each way (T·K rows of D, evenly split): the floor the
dispatchers are measured against. Bandwidth = bytes this rank sends and receives in the exchanges
/ time (the all-gather dispatcher moves more bytes by design; its row counts them as the all-to-all
would, so the column compares time for the same routing).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from moefold.moe.router import Routing
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.expert import DISPATCHERS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after 3 warm-ups (all ranks in step)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _routing(T: int, E: int, K: int, device: torch.device, seed: int) -> Routing:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(device)
    probs_TK = torch.full((T, K), 1.0 / K, device=device)
    scores_TE = torch.zeros(T, E, device=device)
    return Routing(probs_TK=probs_TK, idx_TK=idx_TK, scores_TE=scores_TE, logits_TE=scores_TE)


def measure(args: argparse.Namespace) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = ParallelLayout(ParallelDims(world, ep=world), device.type)
    T, D, K, E = args.tokens, args.hidden, args.top_k, args.experts
    x_TD = torch.randn(T, D, device=device, dtype=dtype)
    routing = _routing(T, E, K, device, seed=rank)
    keep_N = torch.ones(T * K, dtype=torch.bool, device=device)
    row_bytes = D * x_TD.element_size()
    exchanged = 2 * 2 * T * K * row_bytes * (world - 1) / world  # dispatch + combine, send + receive
    results = {}
    for name, cls in DISPATCHERS.items():
        dispatcher = cls(K, E, layout.ep_group, probs_applied_by_experts=True)

        def round_trip(dispatcher=dispatcher):
            sent = dispatcher.dispatch(x_TD, routing, keep_N)
            return dispatcher.combine(sent.x_RD, sent.handle)

        results[name] = _timed(round_trip, device, args.repeats)
    rows = x_TD.new_empty(T * K, D).normal_()
    out = torch.empty_like(rows)

    def plain():
        dist.all_to_all_single(out, rows, group=layout.ep_group)
        dist.all_to_all_single(rows, out, group=layout.ep_group)

    results["all_to_all_single"] = _timed(plain, device, args.repeats)
    return {"world": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "tokens": T, "hidden": D, "top_k": K, "experts": E, "dtype": str(dtype),
            "seconds": results, "gb_per_s": {k: exchanged / s / 1e9 for k, s in results.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=str, default="")
    args = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    result = measure(args)
    if dist.get_rank() == 0:
        print(f"{result['world']} ranks ({backend}, {result['device']}), {args.tokens} tokens × "
              f"hidden {args.hidden}, top-{args.top_k} of {args.experts}, {result['dtype']}")
        print(f"{'exchange':<20} {'ms':>9} {'GB/s':>9} {'vs all_to_all':>14}")
        floor = result["seconds"]["all_to_all_single"]
        for name, seconds in result["seconds"].items():
            print(f"{name:<20} {seconds * 1e3:>9.2f} {result['gb_per_s'][name]:>9.1f} "
                  f"{floor / seconds:>14.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
