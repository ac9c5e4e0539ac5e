"""fp8 (e4m3) block quantisation of optimizer moments that survives resharding.

A block is BLOCK consecutive elements of one row along the last dimension of the *global* tensor
(blocks never cross rows; a row's last block may be short). Its scale depends only on the global
tensor's values, never on how it is sharded, so:

- every parallel layout quantises exactly as one process does (bit-identical, given the same
  values): FSDP and EP/TP shard leading dimensions, which keep rows whole. Where the last dimension
  is split (1-D norm weights under FSDP, row-wise TP, ETP's hidden slice) at block boundaries —
  one mesh dimension splits it and its pieces, ceil(C / ranks) columns, are whole blocks — each
  piece is quantised on its own, like a tensor of its own (no collective; on CUDA the fused
  update takes it). Otherwise each rank takes the maximum over its part of every block it touches
  and one all-reduce (MAX, exact) over the ranks splitting that dimension completes the maxima;
- the scales of a tensor of shape [..., C] have shape [..., ceil(C / BLOCK)] and are sharded like
  the tensor: along its leading dimensions, and along the last one where it splits at block
  boundaries (the scales then split at the same blocks); replicated over the ranks that split it
  elsewhere. DCP reshards them with the moments into any other layout.

R local rows (product of the leading dims), C local columns, L local blocks per row (those the
local columns touch), N blocks per global row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

BLOCK = 128
"""Elements per fp8 scaling block, along the last dimension."""
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MIN_SUBNORMAL = 2.0 ** -9
FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest scale


@dataclass(frozen=True)
class RowBlocks:
    """Where this rank's shard of a tensor sits in the global tensor's blocks."""
    rows: int  # R
    cols: int  # C
    col0: int  # global column of the first local column
    n_blocks: int  # N
    groups: tuple = ()  # process groups that split the last dimension (amax all-reduced over them)

    @property
    def first_block(self) -> int:
        return self.col0 // BLOCK

    @property
    def local_blocks(self) -> int:  # L
        return -(-(self.col0 + self.cols) // BLOCK) - self.first_block if self.cols else 0

    @property
    def lead(self) -> int:  # padding before the first local column inside its block
        return self.col0 % BLOCK


def row_blocks(t: torch.Tensor) -> RowBlocks:
    """The block layout of `t` (a plain tensor, or a DTensor: its local shard)."""
    shape = tuple(t.shape) or (1,)
    if not isinstance(t, DTensor):
        return RowBlocks(math.prod(shape[:-1]), shape[-1], 0, math.ceil(shape[-1] / BLOCK))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local_shape, offset = tuple(local_shape) or (1,), tuple(offset) or (0,)
    splits = _last_dim_splits(t)
    if any(type(t.placements[i]).__name__ == "_StridedShard" for i in splits):  # columns not contiguous
        raise NotImplementedError(f"fp8 optimizer states of a tensor whose last dimension is "
                                  f"strided-sharded ({t.placements}) are not supported")
    if _splits_whole_blocks(t):  # a tensor of its own
        return RowBlocks(math.prod(local_shape[:-1]), local_shape[-1], 0, math.ceil(local_shape[-1] / BLOCK))
    return RowBlocks(math.prod(local_shape[:-1]), local_shape[-1], offset[-1],
                     math.ceil(shape[-1] / BLOCK), tuple(t.device_mesh.get_group(i) for i in splits))


def _last_dim_splits(t: DTensor) -> list[int]:
    """The mesh dimensions whose placement splits t's last dimension."""
    last = max(t.ndim - 1, 0)
    return [i for i, placement in enumerate(t.placements) if getattr(placement, "dim", None) == last]


def _splits_whole_blocks(t: DTensor) -> bool:
    """Whether t's last dimension is split at block boundaries: by one mesh dimension (plain
    Shard), into pieces that hold whole blocks (`pieces_hold_whole_blocks`)."""
    splits = _last_dim_splits(t)
    if len(splits) != 1 or type(t.placements[splits[0]]) is not Shard:
        return False
    return pieces_hold_whole_blocks(t.shape[-1] if t.ndim else 1, t.device_mesh.size(splits[0]))


def pieces_hold_whole_blocks(cols: int, ranks: int) -> bool:
    """Whether `cols` columns split over `ranks` into torch's pieces of ceil(cols / ranks) — which
    the scales' last dimension then follows block for block — are whole blocks or whole rows (one
    rank): every piece starts a block and ends one (or the row), on every rank alike. The memory
    planner asks the same of the weights it knows are split so."""
    piece = -(-cols // ranks)
    return piece % BLOCK == 0 or piece >= cols


def scale_like(t: torch.Tensor) -> torch.Tensor:
    """Ones in the shape of `t`'s block scales: [..., N]; a DTensor sharded like `t` along the
    leading dimensions and, where `t` splits the last one, split at the same blocks or (when its
    pieces cut blocks) replicated."""
    shape = tuple(t.shape) or (1,)
    n = math.ceil(shape[-1] / BLOCK)
    if not isinstance(t, DTensor):
        return torch.ones(*shape[:-1], n, device=t.device)
    local_shape = tuple(t.to_local().shape) or (1,)
    if _splits_whole_blocks(t):  # split at the same blocks as t
        placements, local_n = list(t.placements), math.ceil(local_shape[-1] / BLOCK)
    else:
        splits = _last_dim_splits(t)
        placements = [Replicate() if i in splits else pl for i, pl in enumerate(t.placements)]
        local_n = n
    local = torch.ones(*local_shape[:-1], local_n, device=t.device)
    global_shape = torch.Size((*shape[:-1], n))
    return DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=global_shape,
                              stride=torch.empty(global_shape, device="meta").stride())


# ------------------------------------------------------------------------- one tensor at a time


def _blocks(x: torch.Tensor, b: RowBlocks) -> torch.Tensor:
    """x (R·C elements) → [R, L, BLOCK], zero-padded to whole global blocks."""
    x_RC = x.reshape(b.rows, b.cols)
    return F.pad(x_RC, (b.lead, b.local_blocks * BLOCK - b.lead - b.cols)).view(b.rows, b.local_blocks, BLOCK)


def _unblocks(x_RLB: torch.Tensor, b: RowBlocks, like: torch.Tensor) -> torch.Tensor:
    return x_RLB.reshape(b.rows, b.local_blocks * BLOCK)[:, b.lead:b.lead + b.cols].reshape(like.shape)


def _complete_amax(amax_RL: torch.Tensor, b: RowBlocks) -> torch.Tensor:
    """Block maxima of whole global rows [R, N] from this rank's partial ones [R, L]."""
    if not b.groups and b.local_blocks == b.n_blocks:
        return amax_RL
    amax_RN = amax_RL.new_zeros(b.rows, b.n_blocks)  # |x| >= 0: zero is MAX's identity
    amax_RN[:, b.first_block:b.first_block + b.local_blocks] = amax_RL
    for group in b.groups:
        dist.all_reduce(amax_RN, op=dist.ReduceOp.MAX, group=group)
    return amax_RN


def _local_scales(scale_RN: torch.Tensor, b: RowBlocks) -> torch.Tensor:
    return scale_RN.reshape(b.rows, b.n_blocks)[:, b.first_block:b.first_block + b.local_blocks]


def quantize_fp8(x: torch.Tensor, b: RowBlocks, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32, local) → (e4m3 of x's shape, fp32 scales [R, N]); x ≈ q · scale. `floor` clamps q
    from below (for sqrt(v), see optim/precision.py). A collective when the last dim is split."""
    x_RLB = _blocks(x, b)
    scale_RN = _complete_amax(x_RLB.abs().amax(dim=2), b).div(FP8_MAX).clamp_min(FP32_TINY)
    q_RLB = (x_RLB / _local_scales(scale_RN, b)[:, :, None]).clamp(-FP8_MAX, FP8_MAX)  # >464: NaN
    if floor:
        q_RLB = q_RLB.clamp_min(floor)
    return _unblocks(q_RLB.to(FP8), b, x), scale_RN


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, b: RowBlocks) -> torch.Tensor:
    x_RLB = _blocks(q.float(), b) * _local_scales(scale, b)[:, :, None]
    return _unblocks(x_RLB, b, q)


# ---------------------------------------------------------------------- many tensors at once


def quantize_fp8_many(xs: list[torch.Tensor], bs: list[RowBlocks], floor: float = 0.0):
    """`quantize_fp8` of every tensor with one amax, one division and one cast over all blocks and
    one all-reduce per set of splitting groups; bit-identical to it (max and division are exact
    per element whatever the batching)."""
    if not xs:
        return [], []
    x_MB = torch.cat([_blocks(x, b).reshape(-1, BLOCK) for x, b in zip(xs, bs)])
    sizes = [b.rows * b.local_blocks for b in bs]
    amax = list(x_MB.abs().amax(dim=1).split(sizes))
    amax = _complete_amax_many([a.view(b.rows, b.local_blocks) for a, b in zip(amax, bs)], bs)
    scales = [a.div(FP8_MAX).clamp_min(FP32_TINY) for a in amax]
    # the division reuses the flat layout: each block's scale repeated over its row of x_MB
    scale_M = torch.cat([_local_scales(s, b).reshape(-1) for s, b in zip(scales, bs)])
    q_MB = (x_MB / scale_M[:, None]).clamp(-FP8_MAX, FP8_MAX)
    if floor:
        q_MB = q_MB.clamp_min(floor)
    qs = [_unblocks(q.view(b.rows, b.local_blocks, BLOCK), b, x)
          for q, b, x in zip(q_MB.to(FP8).split(sizes), bs, xs)]
    return qs, scales


def _complete_amax_many(amax: list[torch.Tensor], bs: list[RowBlocks]) -> list[torch.Tensor]:
    """`_complete_amax` of every tensor, with one all-reduce per distinct tuple of groups."""
    out = list(amax)
    by_groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(bs):
        if b.groups or b.local_blocks != b.n_blocks:
            by_groups.setdefault(b.groups, []).append(i)
    for groups, idx in by_groups.items():
        fulls = []
        for i in idx:
            b = bs[i]
            full = amax[i].new_zeros(b.rows, b.n_blocks)
            full[:, b.first_block:b.first_block + b.local_blocks] = amax[i]
            fulls.append(full)
        flat = torch.cat([f.reshape(-1) for f in fulls])
        for group in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for i, f in zip(idx, flat.split([f.numel() for f in fulls])):
            out[i] = f.view(bs[i].rows, bs[i].n_blocks)
    return out


def dequantize_fp8_many(qs: list[torch.Tensor], scales: list[torch.Tensor], bs: list[RowBlocks]):
    if not qs:
        return []
    q_MB = torch.cat([_blocks(q.float(), b).reshape(-1, BLOCK) for q, b in zip(qs, bs)])
    scale_M = torch.cat([_local_scales(s, b).reshape(-1) for s, b in zip(scales, bs)])
    sizes = [b.rows * b.local_blocks for b in bs]
    return [_unblocks(x.view(b.rows, b.local_blocks, BLOCK), b, q)
            for x, b, q in zip((q_MB * scale_M[:, None]).split(sizes), bs, qs)]
