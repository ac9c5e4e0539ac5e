"""Seeded weights that depend on neither the parallel layout nor the device, drawn piece by piece.

A weight's values are a function of (seed, its name, the position of each element) alone: seen as
rows of its last dimension (`[E, K, N]` as E·K rows of N), the weight is cut into blocks of whole
rows (~64 Ki elements), and each block is drawn from its own host generator seeded by (seed,
name, block). A rank therefore draws only the blocks its piece's rows fall in (an EP rank its
experts, an FSDP rank its rows or its slice of each expert) and still gets exactly the values of a
one-process run; only a cut along the last dimension (TP's row-parallel weights, ETP's slices of
`w1`/`w3`) draws whole rows and keeps part of them.
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
    *lead, width = p.shape
    n_rows = math.prod(lead)
    rows = _flat_rows(held[:-1], lead)  # of the [n_rows, width] view, in the piece's order
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, width))
    piece = torch.empty((len(rows), width))
    block_of_row = rows // rows_per_block
    order = torch.argsort(block_of_row, stable=True)
    blocks, counts = torch.unique_consecutive(block_of_row[order], return_counts=True)
    for block, positions in zip(blocks.tolist(), order.split(counts.tolist()), strict=True):
        first = block * rows_per_block
        drawn = _draw_block((min(rows_per_block, n_rows - first), width), seed, name, block)
        piece[positions] = drawn[rows[positions] - first]
    piece = piece.view(*(n if ids is None else len(ids) for ids, n in zip(held[:-1], lead, strict=True)), width)
    if held[-1] is not None:
        piece = piece.index_select(-1, held[-1])
    local_tensor(p).copy_(piece.mul_(std))


def _flat_rows(held: list[torch.Tensor | None], lead: list[int]) -> torch.Tensor:
    """Row numbers, in the `[prod(lead), width]` view, of the rows whose leading indices are the
    product of `held` (None: every index of that dimension), in row-major order."""
    rows = torch.zeros((), dtype=torch.long)
    for ids, n in zip(held, lead, strict=True):
        rows = rows.unsqueeze(-1) * n + (ids if ids is not None else torch.arange(n))
    return rows.reshape(-1)


def _draw_block(shape: tuple[int, ...], seed: int, name: str, block: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator)
