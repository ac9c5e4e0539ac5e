"""The keys and values of the tokens a model has read, per attention layer, for generation.

B batch, K key/value heads (G for GQA; H for MLA, whose keys and values are cached expanded per
head), P positions a call returns, S new positions, Dk / Dv key and value head dims, L the cache's
capacity in positions, W a sliding window.

`Transformer.decode` reads tokens that follow the cached ones: each layer appends their keys and
values and attends its new queries over the cached keys they can see (all of them, or a sliding
window's: the layer's mask at an offset, from its `first_key`, models/attention.py). Training never
builds one: its forward is the plain `Transformer.forward`.

Which cache a layer gets is chosen once, when the cache is built (`layer_cache`): a layer that sees
every key keeps them all (`LayerCache`, one buffer of L positions); a sliding-window layer keeps
the window (`WindowLayerCache`, W positions however long the sequence grows: Mixtral's W = 4096
decoding 32k tokens holds an eighth of the keys). Both count `length` in positions read and refuse
more than L of them: RoPE's positions and `sample`'s restart of a full context are bounded by it.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, in buffers of L positions allocated at first use."""

    first_position = 0  # the absolute position of the first key `extend` returns: it returns them all

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k_BKLDk: torch.Tensor | None = None
        self.v_BKLDv: torch.Tensor | None = None
        self.length = 0

    def extend(self, k_BKSDk: torch.Tensor, v_BKSDv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append S positions; the keys and values of all P + S."""
        S = k_BKSDk.shape[2]
        _check_room(self.capacity, self.length, S, self.k_BKLDk, k_BKSDk.shape[0])
        if self.k_BKLDk is None:
            self.k_BKLDk, self.v_BKLDv = _buffers(k_BKSDk, v_BKSDv, self.capacity)
        end = self.length + S
        self.k_BKLDk[:, :, self.length:end] = k_BKSDk
        self.v_BKLDv[:, :, self.length:end] = v_BKSDv
        self.length = end
        return self.k_BKLDk[:, :, :end], self.v_BKLDv[:, :, :end]


class WindowLayerCache:
    """A sliding-window layer's keys and values: a ring of W slots, position p in slot p mod W.

    Between calls it holds the W − 1 latest positions (all a next query sees besides its own) and
    the slot the next one takes. `extend` returns the keys from `first_position` on, the W − 1
    latest before the call then the S new ones: a single token's W keys are the ring itself, in
    slot order (no copy; one query over keys it sees entirely needs no mask, so no order); S > 1
    new ones, in position order for their mask, are a new tensor of at most W − 1 + S positions
    (a prompt chunk may be longer than W)."""

    def __init__(self, capacity: int, window: int):
        self.capacity, self.window = capacity, window
        self.k_BKWDk: torch.Tensor | None = None
        self.v_BKWDv: torch.Tensor | None = None
        self.length = 0

    @property
    def first_position(self) -> int:
        """The absolute position of the first key the next `extend` returns: the earliest its
        first query sees (SlidingWindowMask.first_key)."""
        return max(0, self.length + 1 - self.window)

    def extend(self, k_BKSDk: torch.Tensor, v_BKSDv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append S positions; the keys and values of positions `first_position`..P + S − 1."""
        S = k_BKSDk.shape[2]
        _check_room(self.capacity, self.length, S, self.k_BKWDk, k_BKSDk.shape[0])
        if self.k_BKWDk is None:
            self.k_BKWDk, self.v_BKWDv = _buffers(k_BKSDk, v_BKSDv, self.window)
        if S == 1:
            self._store(k_BKSDk, v_BKSDv)
            held = min(self.length, self.window)
            return self.k_BKWDk[:, :, :held], self.v_BKWDv[:, :, :held]
        # in position order; read before `_store` overwrites the slots of positions leaving the window
        k_BKPDk = torch.cat([*self._in_order(self.k_BKWDk), k_BKSDk], dim=2)
        v_BKPDv = torch.cat([*self._in_order(self.v_BKWDv), v_BKSDv], dim=2)
        self._store(k_BKSDk, v_BKSDv)
        return k_BKPDk, v_BKPDv

    def _in_order(self, ring_BKWD: torch.Tensor) -> list[torch.Tensor]:
        """The ring's W − 1 latest positions (fewer at the start), in position order."""
        first = self.first_position
        return [ring_BKWD[:, :, a:b] for a, b in self._slots(first, self.length - first)]

    def _store(self, k_BKSDk: torch.Tensor, v_BKSDv: torch.Tensor) -> None:
        """Writes the new positions a later query may see (the last W) into their slots."""
        S = k_BKSDk.shape[2]
        kept = min(S, self.window)
        offset = S - kept
        for a, b in self._slots(self.length + offset, kept):
            self.k_BKWDk[:, :, a:b] = k_BKSDk[:, :, offset:offset + b - a]
            self.v_BKWDv[:, :, a:b] = v_BKSDv[:, :, offset:offset + b - a]
            offset += b - a
        self.length += S

    def _slots(self, position: int, count: int) -> list[tuple[int, int]]:
        """The slot ranges of `count` ≤ W positions from `position` on: one, or two where they wrap."""
        a = position % self.window
        if a + count <= self.window:
            return [(a, a + count)]
        return [(a, self.window), (0, a + count - self.window)]


AnyLayerCache = LayerCache | WindowLayerCache
"""What a layer's `decode` is given: the cache `layer_cache` chose for it."""


def layer_cache(capacity: int, window: int) -> AnyLayerCache:
    """The cache of a layer that sees the latest `window` positions (0: every position). A window
    the capacity never passes has nothing to evict: the full cache, read without a copy."""
    return WindowLayerCache(capacity, window) if 0 < window < capacity else LayerCache(capacity)


def _check_room(capacity: int, length: int, num_new: int, buffer: torch.Tensor | None, batch: int) -> None:
    if length + num_new > capacity:
        raise ValueError(f"KV cache of {capacity} positions cannot take {num_new} more after {length}")
    if buffer is not None and buffer.shape[0] != batch:
        # the slice assignment would broadcast one row into every cached sequence
        raise ValueError(f"KV cache of {buffer.shape[0]} sequences cannot take a batch of {batch}: "
                         "each decode call continues every sequence the cache holds")


def _buffers(k_BKSDk: torch.Tensor, v_BKSDv: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty key and value buffers of `positions`, shaped and typed as the first keys and values."""
    B, K = k_BKSDk.shape[:2]
    return (k_BKSDk.new_empty(B, K, positions, k_BKSDk.shape[-1]),
            v_BKSDv.new_empty(B, K, positions, v_BKSDv.shape[-1]))


class KVCache:
    """Every attention layer's cache; `length`: the positions read so far (the next one's index).
    `windows`: each layer's sliding window (0: it sees every key), all 0 by default."""

    def __init__(self, n_layers: int, capacity: int, windows: list[int] | None = None):
        windows = [0] * n_layers if windows is None else windows
        if len(windows) != n_layers:
            raise ValueError(f"KV cache of {n_layers} layers given {len(windows)} windows")
        self.layers = [layer_cache(capacity, window) for window in windows]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
