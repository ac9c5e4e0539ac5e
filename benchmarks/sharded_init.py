"""How long one rank of a large job takes to fill its seeded weights, on one CPU process.

A job's rank is played by this process under torch's fake process group (every collective a
no-op, `torch.testing._internal.distributed.fake_pg`): the model is built on the meta device,
`parallelize`d for the whole world as the trainer does, and only this rank's pieces are
materialized on the host and filled by `init_weights` — the part of a job's start that grows with
the model. Prints, per shape, the elements the rank holds and draws and the seconds the fill took.
Needs host memory for the rank's pieces in fp32.

    export PYTHONPATH=$PWD/src
    python3 benchmarks/sharded_init.py [--shapes qwen3-30b-a3b:32:ep8,deepseek-v3:512:ep64] [--rank 0] [--threads 1]

A shape is PRESET:WORLD[:epN][:tpN]: FSDP over the data ranks the other sizes leave.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import moefold.models.init as init  # noqa: E402
from moefold.config import load_config  # noqa: E402
from moefold.models.transformer import build_model, materialize  # noqa: E402
from moefold.parallel.apply import parallelize  # noqa: E402
from moefold.parallel.dims import ParallelDims, ParallelLayout  # noqa: E402
from moefold.parallel.local import local_tensor  # noqa: E402


def parse_shape(text: str) -> tuple[str, int, dict[str, int]]:
    preset, world, *sizes = text.split(":")
    parallel = {"ep": 1, "tp": 1}
    for size in sizes:
        key, value = size[:2], size[2:]
        if key not in parallel or not value.isdigit():
            raise SystemExit(f"--shapes {text!r}: {size!r} is not epN or tpN")
        parallel[key] = int(value)
    return preset, int(world), parallel


def fill_one_rank(preset: str, world: int, parallel: dict[str, int], rank: int) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        cfg = load_config(preset, {f"parallel.{k}": str(v) for k, v in parallel.items()})
        layout = ParallelLayout(ParallelDims(world, cfg.parallel.tp, 1, 1, cfg.parallel.ep, 1, cfg.parallel.order))
        with torch.device("meta"):
            model = build_model(cfg, cfg.model.vocab_size)
        drawn = [0]
        draw = init._draw_block
        counting = threading.Lock()  # blocks are drawn by a pool of threads

        def counted_draw(shape, *args, **kwargs):
            with counting:
                drawn[0] += math.prod(shape)
            return draw(shape, *args, **kwargs)

        init._draw_block = counted_draw
        timing = {}

        def initialize(m):
            materialize(m, torch.device("cpu"))
            start = time.perf_counter()
            m.init_weights(cfg.train.seed)
            timing["fill_s"] = time.perf_counter() - start

        try:
            parallelize(model, layout, cfg.parallel, None, initialize)
        finally:
            init._draw_block = draw
        params = list(model.parameters())
        held = sum(local_tensor(p).numel() for p in params)
        return {"elements": sum(p.numel() for p in params), "held": held, "drawn": drawn[0], **timing}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b:32:ep8")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads, and the threads drawing the seeded blocks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| preset | world | layout | model elements | held by the rank | drawn by the rank | fill s "
          "| s per 10^8 drawn |")
    print("|---|---|---|---|---|---|---|---|")
    for text in args.shapes.split(","):
        preset, world, parallel = parse_shape(text)
        r = fill_one_rank(preset, world, parallel, args.rank)
        layout = " ".join(f"{k}{v}" for k, v in parallel.items() if v > 1)
        layout += f" fsdp: dp{world // parallel['tp']} edp{world // parallel['ep']}"
        print(f"| {preset} | {world} | {layout} | {r['elements'] / 1e9:.2f}B | {r['held'] / 1e9:.3f}B "
              f"| {r['drawn'] / 1e9:.3f}B | {r['fill_s']:.1f} | {r['fill_s'] / r['drawn'] * 1e8:.2f} |", flush=True)


if __name__ == "__main__":
    main()
