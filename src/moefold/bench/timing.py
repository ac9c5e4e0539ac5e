"""Timing on the device: CUDA events on a GPU, perf_counter on the CPU; the measured bf16 peak.

Device work is asynchronous, so a GPU region is timed with events recorded on the stream and read
after one synchronisation; warm-up runs first (module load, cuBLAS handles, autotuning) and the
median of several repeats is the result (the device tool's METHOD.md).
"""

import functools
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Marks at step boundaries without a host sync: events on a GPU (read once, at `seconds`),
    perf_counter on the CPU. `mark()` before the first step and after each step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (synchronises on a GPU)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def time_steps(step: Callable[[], object], device: torch.device, steps: int,
               warmup: int) -> tuple[list[float], object]:
    """`warmup` untimed calls of `step`, the peak-memory and allocator-retry counters reset, then
    `steps` calls back to back: (seconds of each, the last call's result). One synchronisation,
    after the timed steps."""
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":  # what `alloc_retries` and the peak then read is the timed steps'
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    clock = StepClock(device)
    clock.mark()
    result = None
    for _ in range(steps):
        result = step()
        clock.mark()
    return clock.seconds(), result


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int = 3,
                   repeats: int = 10) -> float:
    """Median seconds of one call of `fn`, each repeat timed alone (events on a GPU)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        clock = StepClock(device)
        clock.mark()
        fn()
        clock.mark()
        times.extend(clock.seconds())
    return statistics.median(times)


def graph_median_seconds(fn: Callable[[], object], device: torch.device, warmup: int = 3,
                         repeats: int = 10) -> float:
    """Median seconds of the device work of one call of `fn`: on a GPU the call is captured once
    in a CUDA graph and each replay timed alone, so the host's cost of launching it (Python, the
    dispatcher, TMA descriptors, Triton's launcher) does not count. That is what a step pays
    whose host runs ahead of the GPU, as a compiled training step's does. `median_seconds` times
    the call as eager code issues it: a launch that costs the host longer than the kernel runs
    shows up there as idle device time. On the CPU: `median_seconds`."""
    if device.type != "cuda":
        return median_seconds(fn, device, warmup, repeats)
    for _ in range(warmup):
        fn()
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_seconds(graph.replay, device, warmup=1, repeats=repeats)


@functools.cache
def measured_peak_tflops(device: torch.device, size: int = 8192, repeats: int = 20) -> float | None:
    """Dense bf16 matmul TFLOP/s measured on `device` (size³, random inputs rotated over three sets
    so no repeat reads what the last one left in L2); None on the CPU. Once per process and device."""
    if device.type != "cuda":
        return None
    seconds = _matmul_seconds(device, size, repeats)
    torch.cuda.empty_cache()  # the operands died with _matmul_seconds' frame
    return 2 * size**3 / seconds / 1e12


def _matmul_seconds(device: torch.device, size: int, repeats: int) -> float:
    gen = torch.Generator(device).manual_seed(0)
    sets = [(torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen),
             torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen))
            for _ in range(3)]
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    turn = iter(range(10**9))

    def matmul() -> None:
        a, b = sets[next(turn) % len(sets)]
        torch.mm(a, b, out=out)

    return median_seconds(matmul, device, warmup=5, repeats=repeats)


def alloc_retries(device: torch.device) -> int | None:
    """Times the CUDA caching allocator freed its cache and retried a failed cudaMalloc: each one
    synchronizes the device, so a run near the memory limit slows down without running out."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
