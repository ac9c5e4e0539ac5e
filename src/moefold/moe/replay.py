"""Router replay for RL: record the experts every layer chose, or force given choices.

T tokens, L MoE layers (routers), K top-k, E experts.

An RL trainer recomputes the log-probabilities of tokens an inference engine sampled. If the
trainer's routers choose different experts than the engine's did (rounding, another kernel, a newer
weight), the two policies differ by more than the weights; replaying the engine's choices removes
that mismatch, and the combine weights are still computed live so the router keeps learning.

One `RouterReplay` serves all routers of a model. Each router calls `register` once when it is built
(`build_router(dim, cfg, replay)`, in layer order) and receives the next layer index 0..L-1. At run
time a router hands its choice to `route`, which does what the active mode says: choose live (the
default), choose live and record (`record()`), or return the given indices (`replay(...)`). The
modes are objects swapped by the context managers, so a router never branches on them.

The indices are the batch's, [B, S] flattened, whatever the layout: a router that sees only a
shard of the tokens (sequence parallelism, parallel/sequence.py) records the TP group's whole
batch and replays its own rows of it, through its `ReplayedSelection`'s `rows`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from moefold.moe.recomputing import in_backward

Select = Callable[[torch.Tensor], torch.Tensor]  # selection_TE -> idx_TK


class WholeBatch:
    """The rows of a router that routes every token of the batch: the batch's own."""

    def whole(self, idx_TK: torch.Tensor) -> torch.Tensor:
        return idx_TK

    def mine(self, idx_TK: torch.Tensor) -> torch.Tensor:
        return idx_TK

    def whole_tokens(self, num_tokens: int) -> int:
        return num_tokens


class _Live:
    def route(self, layer: int, selection_TE: torch.Tensor, select: Select, rows: WholeBatch) -> torch.Tensor:
        return select(selection_TE)


class _AfterReplay(_Live):
    """Live, except for the recompute of a replayed forward: torch.utils.checkpoint (and
    `checkpoint_wrapper`) runs it in backward, usually after the `replay()` block has closed, and a
    live choice there would route the gradients through other experts than the forward's. It takes
    the indices of the layer's last forward, when that forward was replayed (no live forward of the
    layer ran since), as the global-batch counts' recompute does (moe/balance.py)."""

    def __init__(self, replayed_per_layer: list[torch.Tensor | None]):
        self.replayed_per_layer = replayed_per_layer

    def route(self, layer: int, selection_TE: torch.Tensor, select: Select, rows: WholeBatch) -> torch.Tensor:
        idx_TK = self.replayed_per_layer[layer]
        if idx_TK is None:
            return select(selection_TE)
        if not in_backward():  # a live forward: its own recompute chooses live too
            self.replayed_per_layer[layer] = None
        elif idx_TK.shape[0] == selection_TE.shape[0]:
            return idx_TK
        return select(selection_TE)


class _Recording:
    def __init__(self, num_layers: int):
        self.idx_per_layer: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def route(self, layer: int, selection_TE: torch.Tensor, select: Select, rows: WholeBatch) -> torch.Tensor:
        idx_TK = select(selection_TE)
        if not in_backward():  # a recompute of torch.utils.checkpoint's chose these already
            self.idx_per_layer[layer].append(rows.whole(idx_TK.detach()))
        return idx_TK


class _Replaying:
    def __init__(self, idx_per_layer: list[torch.Tensor], expected: Callable[[int], str]):
        self.idx_per_layer, self.expected = idx_per_layer, expected
        # Each layer's indices of its last forward in the block, for a recompute after it.
        self.forward_idx_per_layer: list[torch.Tensor | None] = [None] * len(idx_per_layer)

    def route(self, layer: int, selection_TE: torch.Tensor, select: Select, rows: WholeBatch) -> torch.Tensor:
        idx_TK = self.idx_per_layer[layer]
        num_tokens = rows.whole_tokens(selection_TE.shape[0])
        if idx_TK.shape[0] != num_tokens:  # shapes live on the host: no sync
            given = [idx_TK.shape[0], len(self.idx_per_layer), idx_TK.shape[1]]
            raise ValueError(f"router replay: expected indices of shape {self.expected(num_tokens)}, "
                             f"got {given} (the batch has {num_tokens} tokens)")
        mine_TK = rows.mine(idx_TK.to(selection_TE.device))
        if not in_backward():
            self.forward_idx_per_layer[layer] = mine_TK
        return mine_TK


class RouterReplay:
    """Shared by every MoE layer's router of one model; layer i is given its index at build time."""

    def __init__(self, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"router replay: num_layers={num_layers} must be >= 1")
        self.num_layers = num_layers
        self.top_k: int | None = None
        self.num_experts: int | None = None
        self._registered = 0
        self._mode: _Live | _Recording | _Replaying = _Live()
        self._last_recording: _Recording | None = None

    def register(self, top_k: int, num_experts: int) -> int:
        """Called by each router at construction; returns its layer index (0, 1, ... in call order)."""
        if self._registered == self.num_layers:
            raise ValueError(f"router replay: built for {self.num_layers} layers, but a router "
                             f"number {self._registered + 1} registered")
        if self.top_k is not None and (top_k, num_experts) != (self.top_k, self.num_experts):
            raise ValueError(f"router replay: every router must have the same top_k and num_experts; "
                             f"got top_k={top_k}, num_experts={num_experts} after top_k={self.top_k}, "
                             f"num_experts={self.num_experts}")
        self.top_k, self.num_experts = top_k, num_experts
        self._registered += 1
        return self._registered - 1

    def route(self, layer: int, selection_TE: torch.Tensor, select: Select,
              rows: WholeBatch = WholeBatch()) -> torch.Tensor:
        """idx_TK of router `layer`, according to the active mode; `rows`: which of the batch's
        tokens the router sees."""
        return self._mode.route(layer, selection_TE, select, rows)

    @contextlib.contextmanager
    def record(self) -> Iterator[RouterReplay]:
        """While active, every router's live choice is kept; `recorded()` returns them afterwards."""
        recording = _Recording(self.num_layers)
        with self._active(recording):
            yield self
        self._last_recording = recording

    def recorded(self) -> torch.Tensor:
        """[T, L, K] int64: the choices of the last `record()`. A layer called several times while
        recording (micro-batches, decode steps) has its calls concatenated along T in call order."""
        if isinstance(self._mode, _Recording):  # else the block before's, as if it were this one's
            raise ValueError("router replay: recorded() called inside `with replay.record():`; "
                             "call it after the block")
        if self._last_recording is None:
            raise ValueError("router replay: nothing recorded; run the model inside `with replay.record():`")
        per_layer = self._last_recording.idx_per_layer
        missing = [layer for layer, calls in enumerate(per_layer) if not calls]
        if missing:
            raise ValueError(f"router replay: layers {missing} of {self.num_layers} recorded nothing")
        idx_per_layer = [torch.cat(calls) for calls in per_layer]
        tokens = [idx.shape[0] for idx in idx_per_layer]
        if len(set(tokens)) > 1:
            raise ValueError(f"router replay: layers recorded different token counts {tokens}")
        return torch.stack(idx_per_layer, dim=1)

    @contextlib.contextmanager
    def replay(self, indices_TLK: torch.Tensor) -> Iterator[RouterReplay]:
        """While active, router of layer l uses indices_TLK[:, l, :] (its combine weights are still
        computed live). Pass the indices on the model's device. Raises ValueError for a malformed
        tensor: the checks sync with the host once, here, not in the routers."""
        indices_TLK = self._validated(indices_TLK)
        idx_per_layer = [idx_TK.contiguous() for idx_TK in indices_TLK.unbind(dim=1)]
        replaying = _Replaying(idx_per_layer, self._expected_shape)
        with self._active(replaying):
            yield self
        self._mode = _AfterReplay(replaying.forward_idx_per_layer)

    @contextlib.contextmanager
    def _active(self, mode: _Recording | _Replaying) -> Iterator[None]:
        if not isinstance(self._mode, _Live):
            raise RuntimeError("router replay: record() and replay() cannot be nested")
        self._mode = mode
        try:
            yield
        finally:
            self._mode = _Live()

    def _expected_shape(self, num_tokens: int | None = None) -> str:
        t = "T" if num_tokens is None else f"T={num_tokens}"
        return f"[{t}, L={self.num_layers}, K={self.top_k}]"

    def _validated(self, indices_TLK: torch.Tensor) -> torch.Tensor:
        if self.top_k is None:
            raise ValueError("router replay: no router registered; build the routers with "
                             "build_router(dim, cfg, replay)")
        expected = self._expected_shape()
        if not isinstance(indices_TLK, torch.Tensor):
            raise ValueError(f"router replay: expected indices of shape {expected}, "
                             f"got {type(indices_TLK).__name__}")
        given = list(indices_TLK.shape)
        if indices_TLK.is_floating_point() or indices_TLK.is_complex() or indices_TLK.dtype == torch.bool:
            raise ValueError(f"router replay: expected integer indices of shape {expected}, "
                             f"got {indices_TLK.dtype} {given}")
        if indices_TLK.dim() != 3 or given[1:] != [self.num_layers, self.top_k]:
            raise ValueError(f"router replay: expected indices of shape "
                             f"{self._expected_shape(given[0] if given else None)}, got {given}")
        indices_TLK = indices_TLK.long()
        self._check_values(indices_TLK)
        return indices_TLK

    def _check_values(self, indices_TLK: torch.Tensor) -> None:
        out_of_range = ((indices_TLK < 0) | (indices_TLK >= self.num_experts)).any()
        sorted_TLK = indices_TLK.sort(dim=-1).values
        duplicate = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any()
        # HOST SYNC: one per replay() call, on the RL data-entry path, never in the routers.
        bad_range, bad_duplicate = torch.stack([out_of_range, duplicate]).tolist()
        if bad_range:
            lo, hi = indices_TLK.min().item(), indices_TLK.max().item()
            raise ValueError(f"router replay: expert ids must be in [0, E={self.num_experts}), "
                             f"got ids from {lo} to {hi}")
        if bad_duplicate:
            token, layer = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(-1).nonzero()[0].tolist()
            raise ValueError(f"router replay: token {token} repeats an expert in layer {layer}: "
                             f"{indices_TLK[token, layer].tolist()} (experts of a token must be distinct)")
