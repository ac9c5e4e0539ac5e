"""FP8 against bf16 at the training step (issue 8's speed table) in one command.

Every row is `moefold bench` of one shape at one precision setting, with a profile of its steps,
in a process of its own, the rows one after another on one GPU: rows side by side on two GPUs, or
one after another in one process, measured their neighbours as much as FP8 (docs/benchmarks.md,
seventh pass). Per shape it prints each row's step time (mean and min over the timed steps), its
tokens/s against the shape's bf16 row, the profiled step's GEMM kernels, and the kernels that only
FP8 runs or grows: the quantizers (`_fp8_*` kernels that are not GEMMs) and Inductor's kernels
(`triton_*`, into which the compiler fuses the rows' quantization); then peak memory and the loss
after the timed steps. Each row trains compiled with the lean optimizer (peers.py's
"moefold-compile-lean"), dropless routing, force-balancing off, random tokens.

    export PYTHONPATH=$PWD/src
    python3 benchmarks/fp8_step.py [--shapes deepseek-v3-small-8l,qwen3-30b-a3b-6l] \\
        [--rows bf16,rowwise:bf16wg,rowwise] [--grad-accum N] [--micro-batch N] [--steps 4] \\
        [--warmup 3] [--set KEY=VALUE ...] [--timeout S] [--json PATH] [--keep DIR]

A row is `bf16` or an FP8 recipe (`tensorwise`, `rowwise`, `blockwise`), followed by options after
colons: `bf16wg` (precision.fp8_weight_grad=bf16), `cache` (precision.fp8_weight_cache=true), e.g.
`rowwise:bf16wg:cache`. `--set` adds a config override to every row (`--set moe.pad_multiple=128`).

Each row's step time is also printed to stderr as soon as the row ends, and `--json` is rewritten
after every row, so a run stopped early (a machine's time limit) keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import COMMON, MOEFOLD_SYSTEMS  # noqa: E402
from peers import SHAPES as PEER_SHAPES  # noqa: E402

# Issue 8's two benchmark shapes (peers.py's), and the production widths of the same families cut
# to fit one H200: DeepSeek-V3 (dim 7168, experts of 2048) and Qwen3-235B-A22B (dim 4096, experts
# of 1536), 4 layers and 16 experts, one 4,096-token sequence a micro-batch (~2,048 rows an expert).
SHAPES = {
    **PEER_SHAPES,
    "deepseek-v3-4l": ("deepseek-v3", {
        "model.n_layers": "4", "moe.first_k_dense": "1", "moe.num_experts": "16", "moe.num_groups": "4",
        "moe.group_top_k": "2", "model.mtp_layers": "0", "train.micro_batch_size": "1"}),
    "qwen3-235b-a22b-4l": ("qwen3-235b-a22b", {
        "model.n_layers": "4", "moe.num_experts": "16", "train.micro_batch_size": "1"}),
}
BENCHMARK_SHAPES = ("deepseek-v3-small-8l", "qwen3-30b-a3b-6l")
RECIPES = ("bf16", "tensorwise", "rowwise", "blockwise")
ROW_OPTIONS = {"bf16wg": {"precision.fp8_weight_grad": "bf16"}, "cache": {"precision.fp8_weight_cache": "true"}}
STEP = MOEFOLD_SYSTEMS["moefold-compile-lean"]


def row_overrides(row: str) -> dict[str, str]:
    """`rowwise:bf16wg:cache` → the config overrides of that row; ValueError names what is allowed."""
    recipe, *options = row.split(":")
    if recipe not in RECIPES:
        raise ValueError(f"row {row!r}: {recipe!r} is not one of {', '.join(RECIPES)}")
    unknown = [o for o in options if o not in ROW_OPTIONS]
    if unknown or (recipe == "bf16" and options):
        raise ValueError(f"row {row!r}: options {options} not allowed; an FP8 recipe takes {', '.join(ROW_OPTIONS)}")
    overrides = {} if recipe == "bf16" else {"precision.fp8": recipe}
    for option in options:
        overrides.update(ROW_OPTIONS[option])
    return overrides


def bench_command(shape: str, row: str, args: argparse.Namespace, out: Path) -> list[str]:
    preset, shape_overrides = SHAPES[shape]
    overrides = {**COMMON, **STEP, **shape_overrides, **row_overrides(row), **dict(args.set)}
    if args.micro_batch:
        overrides["train.micro_batch_size"] = str(args.micro_batch)
    if args.grad_accum:
        overrides["train.grad_accum"] = str(args.grad_accum)
    flags = [token for key, value in overrides.items() for token in (f"--{key}", value)]
    return [sys.executable, "-m", "moefold", "bench", "--config", preset, *flags, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--profile", str(out / "profile"), "--json", str(out / "bench.json")]


def kernel_sums(by_name_tsv: Path) -> dict[str, float]:
    """ms per step of the FP8 quantizers and of Inductor's kernels, from the profile's by-name table."""
    sums = {"quantizers_ms": 0.0, "inductor_ms": 0.0}
    with open(by_name_tsv) as f:
        for row in csv.DictReader(f, delimiter="\t"):
            name, ms = row["name"], float(row["ms_per_step"])
            if name.startswith("_fp8_") and row["class"] != "gemm":
                sums["quantizers_ms"] += ms
            elif name.startswith("triton_"):
                sums["inductor_ms"] += ms
    return sums


def run_row(shape: str, row: str, args: argparse.Namespace, out: Path) -> dict:
    """One row in a fresh process: bench's JSON record with the kernel sums, or why there is none."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.log"
    where = f" (log: {log})" if args.keep else " (--keep DIR keeps the log)"  # else a deleted temp dir
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(bench_command(shape, row, args, out), stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            return {"failed": f"past --timeout {args.timeout:.0f} s{where}"}
    record_path = out / "bench.json"
    if rc != 0 or not record_path.exists():
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        return {"failed": f"moefold bench exited {rc}: {tail[0][:200]}{where}"}
    record = json.loads(record_path.read_text())
    profile = record["profile"]  # bench ran with --profile
    return {**record, **kernel_sums(Path(profile["by_name"])), "gemm_ms": profile["gemm_ms"],
            "gemm_share": profile["gemm_share"], "wall_s": time.monotonic() - start}


def tokens_ratio(row: dict, bf16: dict) -> float | None:
    """The × column: a row's tokens/s over the bf16 row's; None while there is no timed bf16 row."""
    return row["tokens_per_s"] / bf16["tokens_per_s"] if "tokens_per_s" in bf16 else None


def shape_table(shape: str, rows: dict[str, dict]) -> str:
    """One shape's rows; × is tokens/s over the bf16 row's (mean), and its min step over each row's."""
    preset, overrides = SHAPES[shape]
    ref = rows.get("bf16", {})
    lines = [f"{shape} ({preset} + {overrides})",
             f"{'row':24s} {'step ms':>8s} {'(min)':>8s} {'× bf16':>7s} {'(min)':>6s} {'GEMM ms':>8s} {'share':>6s} "
             f"{'quant ms':>8s} {'Inductor':>8s} {'peak GiB':>8s} {'loss':>8s}"]
    for name, r in rows.items():
        if "failed" in r:
            lines.append(f"{name:24s} failed: {r['failed']}")
            continue
        speedup = tokens_ratio(r, ref)
        if speedup is not None:
            ratio = f"{speedup:7.3f} {ref['step_ms_min'] / r['step_ms_min']:6.3f}"
        else:
            ratio = f"{'-':>7s} {'-':>6s}"
        lines.append(f"{name:24s} {r['step_ms_mean']:8.2f} {r['step_ms_min']:8.2f} {ratio} {r['gemm_ms']:8.2f} "
                     f"{r['gemm_share']:6.1%} {r['quantizers_ms']:8.2f} {r['inductor_ms']:8.2f} "
                     f"{r['peak_mem_gib']:8.2f} {r['loss']:8.4f}")
    return "\n".join(lines)


def progress_line(shape: str, row: str, rows: dict[str, dict]) -> str:
    """The row just finished, as soon as it is: its step time and × the shape's bf16 row so far."""
    r, ref = rows[row], rows.get("bf16", {})
    if "failed" in r:
        return f"{shape} {row}: failed: {r['failed']}"
    speedup = tokens_ratio(r, ref)
    ratio = f", × bf16 {speedup:.3f}" if speedup is not None else ""
    return f"{shape} {row}: {r['step_ms_mean']:.2f} ms (min {r['step_ms_min']:.2f}){ratio}"


def write_json(path: Path, results: dict) -> None:
    """The records so far, replacing the file whole (a reader never sees half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"shapes": results}, indent=1))
    partial.replace(path)


def parse_set(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE, e.g. moe.pad_multiple=128")
    return key, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(BENCHMARK_SHAPES))
    p.add_argument("--rows", default="bf16,rowwise:bf16wg,rowwise")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=0, help="sequences a micro-batch (default: the shape's)")
    p.add_argument("--grad-accum", type=int, default=0, help="micro-batches a step (default: 1)")
    p.add_argument("--set", type=parse_set, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one row may take")
    p.add_argument("--json", type=Path, help="the records, rewritten after every row")
    p.add_argument("--keep", type=Path, help="keep every row's log, profile and JSON under this folder")
    args = p.parse_args(argv)
    shapes, row_names = args.shapes.split(","), args.rows.split(",")
    problems = [f"unknown shape {s!r} (allowed: {', '.join(SHAPES)})" for s in shapes if s not in SHAPES]
    for row in row_names:
        try:
            row_overrides(row)
        except ValueError as e:
            problems.append(str(e))
    if args.steps < 1 or args.warmup < 0 or args.micro_batch < 0 or args.grad_accum < 0:
        problems.append("--steps must be >= 1 and --warmup, --micro-batch, --grad-accum >= 0")
    if args.json and not args.json.resolve().parent.is_dir():
        problems.append(f"--json {args.json}: its folder does not exist")
    if problems:
        print(f"fp8_step.py: {'; '.join(problems)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        results = {}
        for shape in shapes:
            results[shape] = {}
            for row in row_names:
                results[shape][row] = run_row(shape, row, args, root / shape / row.replace(":", "+"))
                print(progress_line(shape, row, results[shape]), file=sys.stderr, flush=True)
                if args.json:  # after every row: a run stopped early keeps the rows it finished
                    write_json(args.json, results)
    timed = [r for rows in results.values() for r in rows.values() if "failed" not in r]
    first = timed[0] if timed else {}
    print(f"{first.get('device', '-')}, torch {first.get('torch', '-')}, commit {first.get('commit', '-')}; "
          f"{args.steps} steps after {args.warmup}, rows one after another, each in its own process")
    for shape, rows in results.items():
        print(shape_table(shape, rows))
    return 0 if timed else 1


if __name__ == "__main__":
    raise SystemExit(main())
