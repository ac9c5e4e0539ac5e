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
96.31 / 100.83. The head's loss is the one the trainer builds (train.loss_chunk_tokens), eager.
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
    from moefold.train.loss import build_head_loss, build_objective

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
        # The head loss the trainer builds from the config, eager: what the planner models.
        objective = build_objective(model, build_head_loss(cfg.train.loss_chunk_tokens, compiled=False))
        with alloc:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = objective(model, ids_BS, labels_BS)
            forward = alloc.peak
            alloc.restart_peak()
            loss.backward()
            del loss
        return Peaks(forward, alloc.peak, states, alloc.current)


@dataclass(frozen=True)
class HeadLossPeaks:
    """Bytes one head's loss holds beyond what it keeps for backward, at its most (plan.head's
    `forward_workspace` and `backward_workspace`), and what it keeps."""
    kept: int
    forward: int
    backward: int


def measure_head_loss(cfg: Config, dtype: str = "bf16", input_dtype: str = "", param_dtype: str = "",
                      vocab_size: int = 0) -> HeadLossPeaks:
    """One head's loss alone (the trainer's, from cfg.train.loss_chunk_tokens, eager) on the
    micro-batch's hidden states in `input_dtype` with the head weight in `param_dtype` (both
    default `dtype`), under bf16 autocast unless `dtype` is fp32, every storage followed as in
    `measure_peaks`. Its input is made inside the count (nothing else holds it)."""
    from moefold.train.loss import build_head_loss

    compute = DTYPES[dtype]
    vocab = vocab_size or model_vocab_size(cfg)
    B, S, D = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.dim
    head_loss = build_head_loss(cfg.train.loss_chunk_tokens, compiled=False)
    autocast = torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32)
    with FakeTensorMode():
        head = torch.nn.Linear(D, vocab, bias=False, dtype=DTYPES[param_dtype or dtype])
        x_BSD = torch.randn(B, S, D, dtype=DTYPES[input_dtype or dtype], requires_grad=True)
        labels_BS = torch.randint(0, vocab, (B, S))
        alloc = _Allocations()
        for t in (head.weight, x_BSD, labels_BS):
            alloc.track(t)
        base = alloc.current
        with alloc:
            h_BSD = x_BSD * 1.0  # saves nothing: freed once the loss has run
            with autocast:
                loss = head_loss(head, h_BSD, labels_BS)
            del h_BSD
            kept = alloc.current - base
            forward = alloc.peak - base - kept
            alloc.restart_peak()
            loss.backward()
            backward = alloc.peak - base - kept
    return HeadLossPeaks(kept, forward, backward)
