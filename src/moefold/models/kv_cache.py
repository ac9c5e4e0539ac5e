"""The keys and values of the tokens a model has read, per attention layer, for generation.

B batch, K key/value heads (G for GQA; H for MLA, whose keys and values are cached expanded per
head), P positions cached so far, S new positions, Dk / Dv key and value head dims, L the cache's
capacity in positions.

`Transformer.decode` reads tokens that follow the cached ones: each layer appends their keys and
values and attends its new queries over the cached keys they can see (all of them, or a sliding
window's: the layer's mask at an offset, from its `first_key`, models/attention.py). Training never
builds one: its forward is the plain `Transformer.forward`.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, in buffers of L positions allocated at first use."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.k_BKLDk: torch.Tensor | None = None
        self.v_BKLDv: torch.Tensor | None = None
        self.length = 0

    def extend(self, k_BKSDk: torch.Tensor, v_BKSDv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append S positions; the keys and values of all P + S."""
        B, K, S, _ = k_BKSDk.shape
        if self.length + S > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {S} more after {self.length}")
        if self.k_BKLDk is not None and self.k_BKLDk.shape[0] != B:
            # the slice assignment below would broadcast one row into every cached sequence
            raise ValueError(f"KV cache of {self.k_BKLDk.shape[0]} sequences cannot take a batch of {B}: "
                             "each decode call continues every sequence the cache holds")
        if self.k_BKLDk is None:
            self.k_BKLDk = k_BKSDk.new_empty(B, K, self.capacity, k_BKSDk.shape[-1])
            self.v_BKLDv = v_BKSDv.new_empty(B, K, self.capacity, v_BKSDv.shape[-1])
        end = self.length + S
        self.k_BKLDk[:, :, self.length:end] = k_BKSDk
        self.v_BKLDv[:, :, self.length:end] = v_BKSDv
        self.length = end
        return self.k_BKLDk[:, :, :end], self.v_BKLDv[:, :, :end]


class KVCache:
    """Every attention layer's cache; `length`: the positions read so far (the next one's index)."""

    def __init__(self, n_layers: int, capacity: int):
        self.layers = [LayerCache(capacity) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
