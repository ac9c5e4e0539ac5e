"""`moefold bench` on CUDA: the measured peak, MFU, the kernel profile and the limit (tiny-qwen3);
graph-replayed timing against eager timing."""

import json
import time

import pytest
import torch

from moefold.bench.timing import alloc_retries, graph_median_seconds, median_seconds, time_steps
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


def test_alloc_retries_count_the_timed_steps_only():
    """A warm-up step that makes the allocator free its cache and retry (a 1.5 GiB request over a
    2 GiB cap with 1 GiB cached) is not the timed steps' retry: bench reports 0."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / torch.cuda.get_device_properties(device).total_memory)
    calls = []

    def step():
        if not calls:  # the warm-up
            torch.empty(2**30, dtype=torch.uint8, device=device)  # cached by the allocator once freed
            torch.empty(3 * 2**29, dtype=torch.uint8, device=device)
        calls.append(1)

    try:
        time_steps(step, device, steps=2, warmup=1)
        assert calls == [1, 1, 1]
        assert alloc_retries(device) == 0, "the warm-up's retry counted"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_the_warm_up_retry_is_a_retry():
    """The test above's premise: that warm-up step does make the allocator retry."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / torch.cuda.get_device_properties(device).total_memory)
    try:
        before = alloc_retries(device)
        cached = torch.empty(2**30, dtype=torch.uint8, device=device)
        del cached
        torch.empty(3 * 2**29, dtype=torch.uint8, device=device)
        assert alloc_retries(device) == before + 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
