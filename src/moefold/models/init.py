"""Seeded weights that depend on neither the parallel layout nor the device, drawn piece by piece.

A weight's values are a function of (seed, its name, the position of each element) alone: the
weight is cut along dim 0 into blocks of whole slices (~64 Ki elements, one expert of a stacked
`[E, ...]` weight at least), and each block is drawn from its own host generator seeded by
(seed, name, block). A rank therefore draws only the blocks its piece holds (an EP rank its
experts, an FSDP rank its rows) and still gets exactly the values of a one-process run.
"""

from __future__ import annotations

import hashlib
import math

import torch

from moefold.parallel.local import held_indices, local_tensor

BLOCK_ELEMENTS = 1 << 16


@torch.no_grad()
def seeded_normal_(p: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill `p` (a plain tensor, or a DTensor's piece) with Normal(0, std): its share of the draw
    of the whole weight `name` under `seed`."""
    held = held_indices(p)
    shape = tuple(p.shape)
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    rows = held[0] if held[0] is not None else torch.arange(shape[0])
    piece = torch.empty((len(rows), *shape[1:]))
    block_of_row = rows // rows_per_block
    order = torch.argsort(block_of_row, stable=True)
    blocks, counts = torch.unique_consecutive(block_of_row[order], return_counts=True)
    for block, positions in zip(blocks.tolist(), order.split(counts.tolist()), strict=True):
        first = block * rows_per_block
        drawn = _draw_block((min(rows_per_block, shape[0] - first), *shape[1:]), seed, name, block)
        piece[positions] = drawn[rows[positions] - first]
    for dim, ids in enumerate(held[1:], start=1):
        if ids is not None:
            piece = piece.index_select(dim, ids)
    local_tensor(p).copy_(piece.mul_(std))


def _draw_block(shape: tuple[int, ...], seed: int, name: str, block: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator)
