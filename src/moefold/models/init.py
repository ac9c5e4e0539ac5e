"""Seeded weights that depend on neither the parallel layout nor the device, drawn piece by piece.

A weight's values are a function of (seed, its name, the position of each element) alone: seen as
rows of its last dimension (`[E, K, N]` as E·K rows of N), the weight is cut into blocks of whole
rows (~64 Ki elements), and each block is drawn from its own host generator seeded by (seed,
name, block). A rank therefore draws only the blocks its piece's rows fall in (an EP rank its
experts, an FSDP rank its rows or its slice of each expert) and still gets exactly the values of a
one-process run; only a cut along the last dimension (TP's row-parallel weights, ETP's slices of
`w1`/`w3`) draws whole rows and keeps part of them.

Blocks are independent, so they are drawn by a pool of `torch.get_num_threads()` host threads
(torch's kernels release the GIL), each writing its rows straight into the piece: slices where the
piece's rows run on, an index copy only where they jump.
"""

from __future__ import annotations

import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moefold.parallel.local import held_indices, local_tensor

BLOCK_ELEMENTS = 1 << 16
RESIDUAL_OUTPUTS = ("attn.wo.weight", "w2.weight", "w2_EFD")
"""Names that end the projections writing into the residual stream, drawn depth-scaled (GPT-2)."""


@torch.no_grad()
def init_weights_(module: torch.nn.Module, std: float, residual_std: float, seed: int) -> None:
    """Normal(0, std) for every matrix of `module`, Normal(0, residual_std) for the residual
    outputs, each drawn by `seeded_normal_` under its name in `module`; ones for 1-dim parameters
    (norms); buffers (counters, the expert bias) zero."""
    for name, p in module.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
            continue
        seeded_normal_(p, residual_std if name.endswith(RESIDUAL_OUTPUTS) else std, seed, name)
    for buffer in module.buffers():  # zero, as built (after to_empty(), TorchTitan's way, not)
        buffer.zero_()


@dataclass(frozen=True)
class _BlockCopy:
    """One block's share of a piece: its rows `src` (a slice, or indices, of the block's rows) go to
    the piece's rows `dst` (a slice, or indices, of the piece's `[rows, width]` view)."""

    block: int
    n_rows: int
    src: slice | torch.Tensor
    dst: slice | torch.Tensor


@torch.no_grad()
def seeded_normal_(p: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill `p` (a plain tensor, or a DTensor's piece) with Normal(0, std): its share of the draw
    of the whole weight `name` under `seed`."""
    held = held_indices(p)
    *lead, width = p.shape
    rows = _flat_rows(held[:-1], lead)  # of the [n_rows, width] view, in the piece's order
    target = local_tensor(p).detach()  # the same storage, which `out=` may write to
    on_host = target if target.device.type == "cpu" and target.is_contiguous() else torch.empty(
        target.shape, dtype=target.dtype)
    piece_RW = on_host.view(len(rows), target.shape[-1])
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, width))
    n_rows = math.prod(lead)
    columns = held[-1]

    scratch = threading.local()  # one block's buffer a thread: no allocation (and page faults) a block
    drawn_in_place = piece_RW.dtype == torch.float32 and columns is None

    @torch.no_grad()  # grad mode is per thread: the pool's threads need it said again
    def fill(copy: _BlockCopy) -> None:
        # Few ops a block: the pool's threads share the GIL for each op's Python side.
        if drawn_in_place and isinstance(copy.dst, slice) and _is_slice(copy.src, 0, copy.n_rows):
            _draw_block((copy.n_rows, width), seed, name, copy.block, out=piece_RW[copy.dst]).mul_(std)
            return
        if not hasattr(scratch, "block"):
            scratch.block = torch.empty(rows_per_block * width)
        drawn = scratch.block[:copy.n_rows * width].view(copy.n_rows, width)
        _draw_block((copy.n_rows, width), seed, name, copy.block, out=drawn)
        rows_kept = drawn[copy.src] if isinstance(copy.src, slice) else drawn.index_select(0, copy.src)
        if columns is not None:
            rows_kept = rows_kept.index_select(-1, columns)
        if isinstance(copy.dst, slice):
            torch.mul(rows_kept, std, out=piece_RW[copy.dst])  # in fp32, rounded once to the piece's dtype
        else:
            piece_RW.index_copy_(0, copy.dst, rows_kept.mul(std).to(piece_RW.dtype))

    copies = _block_copies(rows, rows_per_block, n_rows)
    threads = torch.get_num_threads()  # the pool's size, and what intra-op threads return to
    workers = min(threads, len(copies))
    if workers <= 1:
        for copy in copies:
            fill(copy)
    else:
        # One intra-op thread a worker: the pool is the parallelism, and every worker starting
        # torch's intra-op threads for its 64 Ki-element kernels would oversubscribe the cores.
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="seeded_normal") as pool:
                list(pool.map(fill, copies))  # list(): re-raises a worker's exception here
        finally:
            torch.set_num_threads(threads)
    if on_host is not target:
        target.copy_(on_host)


def _is_slice(index: slice | torch.Tensor, start: int, stop: int) -> bool:
    return isinstance(index, slice) and (index.start, index.stop) == (start, stop)


def _block_copies(rows: torch.Tensor, rows_per_block: int, n_rows: int) -> list[_BlockCopy]:
    """What each block drawn gives the piece whose `[rows, width]` view holds the whole weight's
    rows `rows`: slices wherever both sides run on (the piece's rows in order, without gaps within
    a block), indices elsewhere."""
    ascending = len(rows) < 2 or bool((rows[1:] > rows[:-1]).all())
    order = None if ascending else torch.argsort(rows, stable=True)
    sorted_rows = rows if order is None else rows[order]
    blocks, counts = torch.unique_consecutive(sorted_rows // rows_per_block, return_counts=True)
    ends = counts.cumsum(0)
    starts = ends - counts
    firsts = blocks * rows_per_block
    gapless = (sorted_rows[ends - 1] - sorted_rows[starts]) == counts - 1
    copies = []
    for block, first, start, end, runs_on, start_in_block in zip(
            blocks.tolist(), firsts.tolist(), starts.tolist(), ends.tolist(), gapless.tolist(),
            (sorted_rows[starts] - firsts).tolist(), strict=True):
        src = (slice(start_in_block, start_in_block + end - start) if runs_on
               else sorted_rows[start:end] - first)
        dst = slice(start, end) if order is None else order[start:end]
        copies.append(_BlockCopy(block, min(rows_per_block, n_rows - first), src, dst))
    return copies


def _flat_rows(held: list[torch.Tensor | None], lead: list[int]) -> torch.Tensor:
    """Row numbers, in the `[prod(lead), width]` view, of the rows whose leading indices are the
    product of `held` (None: every index of that dimension), in row-major order."""
    rows = torch.zeros((), dtype=torch.long)
    for ids, n in zip(held, lead, strict=True):
        rows = rows.unsqueeze(-1) * n + (ids if ids is not None else torch.arange(n))
    return rows.reshape(-1)


def _draw_block(shape: tuple[int, ...], seed: int, name: str, block: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator, out=out)
