"""The console line, peak memory, the bench's profile and record against what they stand for,
computed here: a window that routed no copy, getrusage's unit on each platform, the bench's
module boundary, capacity per forward, gloo collectives in the CPU profile, tokens per device."""

import ast
import json
import math
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY_OVERRIDES
from memory_runs import one_thread  # noqa: F401 (autouse: ops this small run faster on one thread)
from ranks import run_ranks

from moefold.bench import profile as bench_profile
from moefold.config import load_config
from moefold.moe import stats
from moefold.train import metrics
from moefold.train.trainer import Trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "moefold"


def _record(**moe) -> dict:
    return {"step": 3, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 1000.0, "tflops": 0.001,
            "mfu": None, "peak_mem_gib": 0.5, **moe}


def test_a_window_that_routed_no_copy_prints_no_ratio_of_its_copies():
    """No routed copy (no real token reached an MoE layer): dropped_fraction and load_imbalance
    are nan (null in metrics.jsonl); the console line leaves them out as it leaves out a dropless
    run's 0, where it printed 'dropped nan%' and 'imbalance nan'."""
    zero = {stats.TOKENS: torch.zeros(4, dtype=torch.int64), stats.DROPPED: torch.zeros((), dtype=torch.int64),
            stats.ENTROPY_SUM: torch.zeros(()), stats.ENTROPY_TOKENS: torch.zeros((), dtype=torch.int64)}
    moe = stats.summarize([zero, dict(zero)])
    moe.pop("tokens_per_expert_per_layer")
    assert math.isnan(moe["dropped_fraction"]) and math.isnan(moe["load_imbalance"])
    line = metrics.format_line(_record(**moe), 10)
    assert "nan" not in line and "dropped" not in line and "imbalance" not in line, line
    # a window that routed copies still shows both
    line = metrics.format_line(_record(load_imbalance=1.25, dropped_fraction=0.125), 10)
    assert line.endswith("mem 0.50 GiB | imbalance 1.25 | dropped 12.5%"), line


@pytest.mark.parametrize("platform, maxrss", [("linux", 3 * 2**20), ("darwin", 3 * 2**30)])
def test_peak_cpu_memory_reads_getrusage_in_its_platform_s_unit(monkeypatch, platform, maxrss):
    """ru_maxrss is KiB on Linux and bytes on macOS (getrusage(2) of each): 3 GiB either way."""
    monkeypatch.setattr(metrics.sys, "platform", platform)
    monkeypatch.setattr(metrics.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=maxrss))
    assert metrics.peak_memory_gib(torch.device("cpu")) == 3.0


def test_bench_imports_no_private_name_of_another_module():
    """The bench's modules use other modules' public names only (limit.py took flops._in_units,
    cli.py metrics._finite_or_null)."""
    private = []
    for path in sorted((SRC / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moefold"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
