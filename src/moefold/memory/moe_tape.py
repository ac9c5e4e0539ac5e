"""Routing replay for recomputed MoE layers.

A checkpointed region that holds an MoE layer (memory.recompute = ["moe"] or ["layer"]) runs the
layer's forward a second time in backward. That run must take the decisions its forward took — the
experts of each token, the capacity mask, the routed counts (summed over the data-parallel ranks in
the forward), the per-sequence counts (summed over the TP ranks' sequence shards under sequence
parallelism) and the global-batch counts — and record nothing: the load statistics, the step's counts
for the expert-bias update, the global aux-loss counts and a router-replay recording are taken once,
by the forward, and no collective runs again.

`moe_recompute_contexts(layers)` gives torch.utils.checkpoint's `context_fn` pair: the forward
context tapes what each decision returned, the recompute context hands the taped results back in
order and skips `MoELayer._record`. Both swap the parts' attributes for the duration of one run, as
RouterReplay swaps its modes, so the MoE forward itself never asks whether it is recomputing.
Replaying the forward's decisions instead of trusting a re-run to reproduce them also keeps the
recompute's shapes and counts equal when a GPU kernel is not bitwise deterministic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from moefold.memory.sites import Site
from moefold.moe.layer import MoELayer

# (part of the layer, attribute): the calls whose results a recompute must reproduce exactly.
_DECISIONS = (("router", "select"), ("", "capacity"), ("", "count_routed"), ("balancer", "_accumulate"),
              ("balancer", "_sequence_counts"))


def _decision_sites(layer: MoELayer) -> list[Site]:
    return [Site(getattr(layer, part) if part else layer, name) for part, name in _DECISIONS]


def moe_recompute_contexts(layers: list[MoELayer]):
    """(forward context, recompute context) sharing one tape per layer."""
    tapes = [{site: [] for site in _decision_sites(layer)} for layer in layers]
    return _taping(tapes), _EachEntry(lambda: _replaying(layers, tapes))


class _EachEntry:
    """A context made anew on each entry: the checkpoint enters its recompute context once per
    recompute, and a retained graph's next backward recomputes again (a generator context, entered
    twice, raised AttributeError)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self._make, self._entered = make, []

    def __enter__(self) -> None:
        self._entered.append(self._make())
        self._entered[-1].__enter__()

    def __exit__(self, *exc) -> bool | None:
        return self._entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _taping(tapes: list[dict[Site, list]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for tape in tapes:
            for site, results in tape.items():
                stack.enter_context(_swapped(site, lambda fn, results=results: _taped(fn, results)))
        yield


@contextlib.contextmanager
def _replaying(layers: list[MoELayer], tapes: list[dict[Site, list]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for layer, tape in zip(layers, tapes):
            for site, results in tape.items():
                stack.enter_context(_swapped(site, lambda fn, results=results: _replayed(results)))
            stack.enter_context(_swapped(Site(layer, "_record"), lambda fn: _skip))
        yield


def _taped(fn: Callable, results: list) -> Callable:
    def call(*args, **kwargs):
        # Decisions are integers and masks, never differentiated; without a graph here they save
        # nothing (top-k would keep its indices), so the replay saves as many tensors as the forward.
        with torch.no_grad():
            results.append(fn(*args, **kwargs))
        return results[-1]
    return call


def _replayed(results: list) -> Callable:
    taped = iter(results)  # a fresh iterator per recompute (a retained graph may recompute twice)

    def call(*args, **kwargs):
        return next(taped)
    return call


def _skip(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def _swapped(site: Site, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """`site` wrapped by `make` inside the block, restored after (also when the checkpoint stops a
    recompute early by raising)."""
    owner, name = site.owner, site.name
    own = vars(owner).get(name, _MISSING)
    site.wrap(make)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(owner, name)  # back to the class's method
        else:
            setattr(owner, name, own)


_MISSING = object()
