"""`moefold bench` on CUDA: the measured peak, MFU, the kernel profile and the limit (tiny-qwen3);
graph-replayed timing against eager timing."""

import json
import time

import pytest
import torch

from moefold.bench.timing import graph_median_seconds, median_seconds
from moefold.cli import main

pytestmark = pytest.mark.gpu


def test_bench_on_cuda_reports_mfu_profile_and_limit(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "--config", "tiny-qwen3", "--train.device", "cuda", "--steps", "5",
                 "--warmup", "2", "--json", str(path), "--profile", str(tmp_path / "prof"),
                 "--limit", "--limit-repeats", "3"]) == 0
    out = capsys.readouterr().out
    r = json.loads(path.read_text())
    assert r["compute_dtype"] == "bfloat16" and r["device"] != "cpu"
    assert 100 < r["peak_tflops_measured"] < 5000  # a bf16 8192³ matmul on any current GPU
    assert 0 < r["mfu"] < 1, r["mfu"]
    assert r["mfu"] == pytest.approx(r["tflops"] / r["peak_tflops_measured"])
    assert r["peak_mem_gib"] > 0 and "% of the measured" in out
    p = r["profile"]
    assert (tmp_path / "prof" / "trace.json").is_file() and "top kernels by self device time" in out
    assert p["gemm_ms"] > 0 and p["attention_ms"] > 0  # kernel names recognised
    rows = [line.split("\t") for line in (tmp_path / "prof" / "by-name.tsv").read_text().splitlines()[1:]]
    assert sum(float(r[0]) for r in rows if r[2] == "gemm") == pytest.approx(p["gemm_ms"], rel=1e-4, abs=1e-4)
    for key in ("gemm_share", "attention_share", "outside_share"):
        assert 0 <= p[key] <= 1
    assert r["limit"]["total_ms"] > 0 and r["limit_fraction"] > 0


def test_graph_timing_counts_device_work_not_the_hosts_launch():
    """A call whose host side sleeps 20 ms before one small kernel: eager timing sees the sleep as
    idle device time, graph replay sees the kernel alone (what a step whose host runs ahead pays)."""
    device = torch.device("cuda")
    x = torch.randn(1024, 1024, device=device)

    def slow_host_call():
        time.sleep(0.02)
        return x * 2

    assert median_seconds(slow_host_call, device, warmup=1, repeats=3) > 0.015
    assert graph_median_seconds(slow_host_call, device, warmup=1, repeats=3) < 0.002
