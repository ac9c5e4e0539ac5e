"""`moefold bench` behind the command line: checks the options, runs the steps, prints the table
(and the profile and the limit when asked), writes the JSON record."""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
from pathlib import Path
from typing import Any

from moefold.config import Config
from moefold.errors import UserError, refuse_unwritable_dir


def check_args(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UserError(f"--steps {args.steps} must be >= 1")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0")
    if args.profile_steps < 1:
        raise UserError(f"--profile-steps {args.profile_steps} must be >= 1")
    if args.limit_repeats < 1:
        raise UserError(f"--limit-repeats {args.limit_repeats} must be >= 1")
    world = os.environ.get("WORLD_SIZE", "1")
    if args.limit and world != "1":
        raise UserError(f"--limit times the whole model's kernels on one device, not a rank's share of them "
                        f"(WORLD_SIZE={world}): run it in one process, without torchrun")
    if args.profile is not None:
        refuse_unwritable_dir(args.profile, "--profile")  # checked before the steps run, not after
    if args.json is not None:
        if args.json.is_dir():
            raise UserError(f"--json {args.json} is a directory; give a file path")
        refuse_unwritable_dir(args.json.parent, "--json", given=args.json)
        if args.profile is not None and _profile_writes(args.profile, args.json):
            raise UserError(f"--json {args.json} is where --profile {args.profile} writes; give "
                            f"another file path")


def _profile_writes(profile_dir: Path, path: Path) -> bool:
    """Whether `path` is the --profile directory or a file written there (trace.json, by-name.tsv,
    trace-rankR.json, by-name-rankR.tsv). The directory failed the record's write after every step
    had run (IsADirectoryError); a file there was overwritten by the other output."""
    profile_dir, path = profile_dir.resolve(), path.resolve()
    return path == profile_dir or (path.parent == profile_dir
                                   and re.fullmatch(r"(trace|by-name)(-rank\d+)?\.(json|tsv)", path.name) is not None)


def run(args: argparse.Namespace, cfg: Config, overrides: dict[str, Any]) -> int:
    import torch

    from moefold.bench.limit import format_limit, step_limit
    from moefold.bench.profile import format_profile, profile_steps
    from moefold.bench.run import format_record, run_bench
    from moefold.train.metrics import finite_or_null

    check_args(args)
    result = run_bench(cfg, args.steps, args.warmup)
    trainer, record = result.trainer, result.record
    record.update(config=args.config or "tiny", overrides=overrides)
    speak = trainer.dist.is_main
    if args.profile is not None:
        trace_name = "trace.json" if trainer.dist.world == 1 else f"trace-rank{trainer.dist.rank}.json"
        record["profile"] = profile_steps(trainer.train_step, trainer.device, args.profile_steps,
                                          args.profile, trace_name)
    if args.limit:
        device, dtype, micro_batches = trainer.device, trainer.compute_dtype, trainer.grad_accum
        del trainer, result  # the limit builds its own tensors (and a model for the optimizer)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        limit = step_limit(cfg, device, dtype, repeats=args.limit_repeats, micro_batches=micro_batches)
        record["limit"] = limit
        record["limit_fraction"] = limit["total_ms"] / record["step_ms_mean"]
        record["limit_fraction_no_optimizer"] = limit["no_optimizer_ms"] / record["step_ms_mean"]
    if speak:
        print(f"moefold bench --config {record['config']}"
              + "".join(f" --{k} {v}" for k, v in overrides.items()))
        print(format_record(record))
        if "profile" in record:
            print(format_profile(record["profile"]))
        if "limit" in record:
            print(format_limit(record["limit"]))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            # a diverged step's nan loss as null, as metrics.jsonl writes it: JSON has no NaN
            args.json.write_text(json.dumps(finite_or_null(record), indent=1, allow_nan=False) + "\n")
            print(f"record: {args.json}")
    return 0


def add_arguments(bench: argparse.ArgumentParser) -> None:
    from moefold.cli import path_argument  # refuses an empty path (Path('') is the current directory)

    bench.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps (default 10)")
    bench.add_argument("--warmup", type=int, default=3, metavar="W",
                       help="untimed steps first (default 3)")
    bench.add_argument("--profile", type=path_argument, metavar="DIR",
                       help="after the timed steps, profile --profile-steps more: DIR/trace.json "
                            "(Chrome trace; trace-rankR.json under several ranks), DIR/by-name.tsv "
                            "(every kernel's time per step) and the top kernels, GEMM / attention / "
                            "communication / other")
    bench.add_argument("--profile-steps", type=int, default=2, metavar="N",
                       help="steps under the profiler (default 2)")
    bench.add_argument("--limit", action="store_true",
                       help="also time the step's large kernels alone (benchmarks/limit.py) and "
                            "report the step time against their sum")
    bench.add_argument("--limit-repeats", type=int, default=10, metavar="N",
                       help="repeats per kernel group for --limit (median; default 10)")
    bench.add_argument("--json", type=path_argument, metavar="PATH", help="write the result record as JSON")
