"""FP8 against bf16 over a whole training run: the same preset, data and seed, one run per recipe.

Each run is `moefold train` in its own process (so one run's compiled graphs and memory do not touch
the next). The table gives each run's final validation loss, its difference from the bf16 run's
(issue 8 asks for at most 1.5%) and its median throughput; the plot shows the training loss
(smoothed over 20 steps) and the validation loss of every run.

    export PYTHONPATH=$PWD/src
    python3 benchmarks/fp8_convergence.py --out /tmp/fp8conv [--recipes off,rowwise] \
        [--plot docs/fp8_convergence.png] [-- extra moefold train options]

Defaults: preset qwen3-moe-300m (1,000 steps of 8 × 2048 tokens of the embedded corpus),
`train.compile true`. A run directory that already holds metrics is read, not trained again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def train(run_dir: Path, preset: str, recipe: str, extra: list[str]) -> None:
    if (run_dir / "metrics.jsonl").exists():
        return
    cmd = [sys.executable, "-m", "moefold", "train", "--config", preset, "--run-dir", str(run_dir),
           "--precision.fp8", recipe, "--train.compile", "true", "--logging.progress_bar", "false",
           "--checkpoint.save_at_end", "false", *extra]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def read(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"], r.get("tokens_per_s")) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return {"train": train, "val": val}


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def table(runs: dict[str, dict]) -> str:
    base = runs.get("off", {}).get("val")
    lines = [f"{'recipe':12s} {'final val':>10s} {'vs bf16':>8s} {'tok/s (median)':>15s}"]
    for recipe, run in runs.items():
        final = run["val"][-1][1]
        diff = f"{100 * (final / base[-1][1] - 1):+7.2f}%" if base else f"{'-':>8s}"
        rates = [r for _, _, r in run["train"] if r]
        rate = f"{statistics.median(rates):15,.0f}" if rates else f"{'-':>15s}"
        lines.append(f"{('bf16' if recipe == 'off' else recipe):12s} {final:10.4f} {diff} {rate}")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe, run in runs.items():
        label = "bf16" if recipe == "off" else f"fp8 {recipe}"
        steps, losses, _ = zip(*run["train"])
        ax_train.plot(steps, smooth(list(losses), 20), label=label)
        ax_val.plot(*zip(*run["val"]), marker="o", label=label)
    for ax, name in ((ax_train, "training loss (20-step mean)"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the run directories")
    p.add_argument("--preset", default="qwen3-moe-300m")
    p.add_argument("--recipes", default="off,rowwise", help="precision.fp8 values; off = bf16")
    p.add_argument("--plot", type=Path, help="write the curves to this PNG")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then more `moefold train` options")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    runs = {}
    for recipe in args.recipes.split(","):
        run_dir = args.out / recipe
        train(run_dir, args.preset, recipe, extra)
        runs[recipe] = read(run_dir)
    print(table(runs))
    if args.plot:
        plot(runs, args.plot, f"{' '.join([args.preset, *extra])}: bf16 and FP8")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
