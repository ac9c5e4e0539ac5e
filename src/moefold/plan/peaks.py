"""The independent check of the planner's time order: run one real training micro-batch (forward,
loss, backward) under `FakeTensorMode` (shapes and dtypes, no memory) and follow every storage the
ops make from its allocation until it is freed, as a GPU caching allocator's `memory_allocated`
would (without its rounding and fragmentation). Gives the forward and backward peaks of one
process, parameters, gradients and optimizer states included.

Parameters in `param_dtype` under bf16 autocast: "fp32" is the fp32-master run of
benchmarks/memory.py (fp32 parameters, gradients and AdamW moments); "bf16" keeps bf16 parameters
and gradients, with the moments planned for `cfg.optim` allocated as fp32 (fp8 / bf16 moment
layouts are the planner's `_states`, checked by their own tests). On the H200 the fp32-master
Qwen3-30B-A3B 6-layer run measured 96.26 / 100.90 GiB (forward / backward) where this gives
96.20 / 100.84.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moefold.config import Config
from moefold.data.tokenizer import model_vocab_size
from moefold.plan.measure import DTYPES, _cast_params, _fused_attention


@dataclass(frozen=True)
class Peaks:
    """Bytes allocated at each phase's peak, and what was held between phases."""
    forward: int
    backward: int
    states: int  # parameters and optimizer moments, before forward
    after_backward: int  # states and gradients (the optimizer step's base)


class _Allocations(TorchDispatchMode):
    """Live bytes of every storage an op made (each storage once, freed with its last tensor)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.current += self.live[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def restart_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def measure_peaks(cfg: Config, param_dtype: str = "fp32", vocab_size: int = 0) -> Peaks:
    """Forward and backward peaks of one micro-batch of `cfg` on one process, bf16 autocast."""
    from moefold.models.transformer import build_model
    from moefold.moe.experts import grouped_mm_supported
    from moefold.train.loss import build_objective

    grouped_mm_supported("cpu", torch.bfloat16)  # cached probe with real tensors, outside fake mode
    vocab = vocab_size or model_vocab_size(cfg)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    with FakeTensorMode(), _fused_attention():
        model = _cast_params(build_model(cfg, vocab, "cpu", torch.bfloat16), DTYPES[param_dtype]).train()
        alloc = _Allocations()
        moments = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters() for _ in range(2)]
        for t in (*model.parameters(), *model.buffers(), *moments):
            alloc.track(t)
        ids_BS, labels_BS = torch.randint(0, vocab, (B, S)), torch.randint(0, vocab, (B, S))
        states = alloc.current
        with alloc:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = build_objective(model)(model, ids_BS, labels_BS)
            forward = alloc.peak
            alloc.restart_peak()
            loss.backward()
            del loss
        return Peaks(forward, alloc.peak, states, alloc.current)
