"""ZeRO-1 for `parallel.data_parallel = ddp`: parameters replicated, optimizer states sharded.

Forward and backward read the model's full parameters, replicated over the data ranks as in plain
DDP. After the step's last backward the gradients are reduce-scattered over their data-parallel
group (dense over dp·cp, experts over edp, both divided by dp·cp: parallel/data.py says why), so a
rank receives the averaged gradient of its own shard only. The optimizer holds only those shards and
keeps states for them (moments, PrecisionAwareAdamW's master remainders); after its step the updated
shards are all-gathered back into the full parameters. As Megatron-Core's distributed optimizer and
TorchTitan's DDP: states cost 1/dp·cp (dense) or 1/edp (experts) per rank, at the communication
volume of one all-reduce (a reduce-scatter plus an all-gather).

Shards are DTensors laid out as FSDP2 lays out the same parameter: the data-parallel mesh comes
first, the parameter's own (TP, EP/ETP) mesh dims after it, and the data ranks split d, the first
dim of this rank's piece they split evenly — dim 0 for nearly every tensor. Where TP or EP split d
too, the data placement is FSDP2's `_StridedShard` (the data ranks split each TP/EP piece, not the
whole dim), else a plain `Shard(d)`. With dim 0 this rank's rows are contiguous in the parameter, so
the shard is a view of it: the optimizer updates the parameter in place and no master copy exists,
as with Megatron's buffers. A shard along a later dim (the tiny models' 257-row embedding splits dim
1) is a copy; a piece with no even dim takes dim 0's uneven torch.chunk rows (some ranks none).
(Nesting a plain Shard after TP/EP's on the same dim, data mesh last, would be simpler to write,
but DTensor cannot redistribute it: the meshes it would merge are out of the root mesh's order.)
Being ordinary sharded tensors:
- torch's get/set_optimizer_state_dict key their states by the model's names (through `ShardModule`,
  which registers each shard under its parameter's name) and DCP reshards them into any other layout
  or world size, FSDP and one process included, in their own dtypes;
- GradNormClipper counts each shard's replication from its placements;
- PrecisionAwareAdamW's fp8 blocks complete their maxima over the data ranks where a shard splits
  the last dim (optim/blocks.py), so every layout quantises as one process does.
Megatron cuts one flat buffer at arbitrary element boundaries instead: no copies into and out of the
collectives, but a shard is then no tensor of its own and checkpoints need its own resharding code.

Flat buckets. The parameters of one (group, dtype) go into buckets of at most BUCKET_ELEMENTS, each
one reduce-scatter and one all-gather over a rank-major buffer [W, S]: segment w holds rank w's rows
of every parameter in the bucket, each padded to C rows so that all segments are equal.

Legend: W ranks in the data-parallel group, S elements in a segment; a parameter's local piece (its
TP/EP shard, or itself) is viewed as [P, N, Q]: N rows along the shard dim, P and Q the products of
the dims before and after it, C = ceil(N / W) rows in each rank's slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moefold.optim.precision import replace_local
from moefold.parallel.collectives import all_gather_single, reduce_scatter_single
from moefold.parallel.data import DataParallel, dense_parameters, expert_parameters
from moefold.parallel.local import local_tensor

BUCKET_ELEMENTS = 2 ** 26
"""Elements (all ranks' segments) of one bucket: bounds the flat buffers' extra memory (256 MiB
of fp32) while keeping collectives few (Megatron-Core's buckets are of a similar size)."""


def shard_dim(local_shape: torch.Size, world: int) -> int:
    """The first dim of a local piece the `world` data ranks split evenly; dim 0 (torch.chunk's
    uneven rows) when none does."""
    return next((d for d, n in enumerate(local_shape) if n % world == 0), 0)


def chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s chunk of n rows split over `world` ranks as torch.chunk (and
    DTensor's Shard) splits them: ceil(n / world) each, the last ones shorter or empty."""
    per_rank = -(-n // world)
    row0 = min(rank * per_rank, n)
    return row0, min(per_rank, n - row0)


def _data_placement(d: int, own_placements: tuple, own_mesh: DeviceMesh | None):
    """The data ranks' placement of dim d, placed before the parameter's own mesh dims: Shard(d),
    or, where TP/EP split d too, FSDP2's _StridedShard, which says the data ranks split each of
    their pieces rather than the whole dim (DTensor reads placements left to right)."""
    split = math.prod(own_mesh.size(i) for i, pl in enumerate(own_placements)
                      if pl.is_shard() and pl.dim == d)
    return _StridedShard(d, split_factor=split) if split > 1 else Shard(d)


@dataclass
class _Slot:
    """One parameter and its shard: this rank holds rows [row0, row0 + rows) of the [P, N, Q] local
    piece; in every segment of a bucket the parameter takes P·C·Q elements from `offset`."""
    param: nn.Parameter  # the model's, full
    shard: nn.Parameter | None  # the optimizer's (set by `of`)
    P: int
    N: int
    Q: int
    C: int
    row0: int
    rows: int
    shard_shape: tuple[int, ...]  # of the shard's local tensor
    offset: int = 0

    @classmethod
    def of(cls, p: nn.Parameter, dp_mesh: DeviceMesh, meshes: dict) -> _Slot:
        """`p` and its new shard: a DTensor over `dp_mesh` followed by `p`'s own mesh (if any)."""
        if p.dim() == 0:
            raise ValueError("parallel.data_parallel=ddp (ZeRO-1) cannot shard a 0-dim parameter")
        world, shape = dp_mesh.size(), local_tensor(p).shape
        d = shard_dim(shape, world)
        row0, rows = chunk_rows(shape[d], world, dp_mesh.get_local_rank())
        own = p.device_mesh if isinstance(p, DTensor) else None
        if (own, dp_mesh) not in meshes:  # private, but how FSDP2 builds its 2-D meshes too
            meshes[own, dp_mesh] = dp_mesh if own is None else DeviceMesh._concatenate([dp_mesh, own])
        own_placements = tuple(getattr(p, "placements", ()))
        slot = cls(p, None, math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:]),
                   -(-shape[d] // world), row0, rows, (*shape[:d], rows, *shape[d + 1:]))
        placements = (_data_placement(d, own_placements, own), *own_placements)
        slot.shard = nn.Parameter(DTensor.from_local(slot.rows_as_shard(), meshes[own, dp_mesh], placements,
                                                     run_check=False, shape=p.shape, stride=p.stride()),
                                  requires_grad=p.requires_grad)
        return slot

    def rows_of_param(self) -> torch.Tensor:
        """[P, rows, Q]: this rank's rows of the parameter's local piece (a view)."""
        full_PNQ = local_tensor(self.param).detach().view(self.P, self.N, self.Q)
        return full_PNQ[:, self.row0:self.row0 + self.rows]

    def rows_as_shard(self) -> torch.Tensor:
        """This rank's rows of the parameter as the shard's local tensor: a view where they are
        contiguous (dim 0 split evenly), so the optimizer updates the parameter in place; else a
        copy."""
        rows = self.rows_of_param()
        local = rows if rows.is_contiguous() else rows.clone(memory_format=torch.contiguous_format)
        return local.view(self.shard_shape)

    def aliased(self) -> bool:
        return local_tensor(self.shard).data_ptr() == self.rows_of_param().data_ptr()

    @property
    def size(self) -> int:
        return self.P * self.C * self.Q

    def in_segments(self, buf_WS: torch.Tensor) -> torch.Tensor:
        """[W, P, C, Q]: the parameter's slot in every rank's segment."""
        return buf_WS[:, self.offset:self.offset + self.size].view(-1, self.P, self.C, self.Q)

    def own_rows(self, buf_S: torch.Tensor) -> torch.Tensor:
        """[P, rows, Q]: this rank's rows in its own segment."""
        return buf_S[self.offset:self.offset + self.size].view(self.P, self.C, self.Q)[:, :self.rows]

    def shard_rows(self) -> torch.Tensor:
        """[P, rows, Q]: the shard's values."""
        return local_tensor(self.shard).detach().view(self.P, self.rows, self.Q)

    def set_gradient(self, rows: torch.Tensor) -> None:
        """`rows` (this rank's averaged gradient rows) become the shard's gradient, which the model's
        parameter shows too (a DTensor: full_tensor() gathers the whole average)."""
        s = self.shard
        local = rows.to(s.dtype).reshape(self.shard_shape)
        s.grad = DTensor.from_local(local, s.device_mesh, s.placements, run_check=False, shape=s.shape,
                                    stride=s.stride())
        self.param.grad = s.grad


def _full_gradient(p: nn.Parameter) -> torch.Tensor:
    """The local piece of `p`'s gradient: zeros when it got none (every rank must send the same
    sizes), completed where it is still a partial sum (a sequence-parallel norm weight's)."""
    g = p.grad
    if g is None:
        return torch.zeros_like(local_tensor(p))
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


class _Bucket:
    """Parameters of one data-parallel group and dtype whose gradients are reduce-scattered, and
    shards all-gathered, in one collective each."""

    def __init__(self, slots: list[_Slot], group, divide_by: int, reduce_dtype: torch.dtype | None):
        self.slots, self.group, self.divide_by = slots, group, divide_by
        self.world = dist.get_world_size(group)
        offset = 0
        for slot in slots:
            slot.offset, offset = offset, offset + slot.size
        self.segment = offset  # S
        self.dtype = slots[0].param.dtype
        self.reduce_dtype = reduce_dtype or self.dtype
        self.device = local_tensor(slots[0].param).device

    def reduce_scatter(self) -> None:
        """Each slot's averaged gradient rows become its shard's gradient; the full gradients are
        freed as they are copied in."""
        W = self.world
        send_WS = torch.zeros(W, self.segment, dtype=self.reduce_dtype, device=self.device)
        for slot in self.slots:
            g_PNQ = _full_gradient(slot.param).reshape(slot.P, slot.N, slot.Q)
            padded = F.pad(g_PNQ, (0, 0, 0, W * slot.C - slot.N))
            slot.in_segments(send_WS).copy_(padded.view(slot.P, W, slot.C, slot.Q).transpose(0, 1))
            slot.param.grad = None
        recv_S = torch.empty(self.segment, dtype=self.reduce_dtype, device=self.device)
        reduce_scatter_single(recv_S, send_WS.view(-1), group=self.group)
        recv_S.div_(self.divide_by)
        for slot in self.slots:
            slot.set_gradient(slot.own_rows(recv_S))

    def all_gather(self) -> None:
        """Every rank's updated rows into the full parameters; their gradients (the shards') are
        dropped so that the next backward starts afresh."""
        W = self.world
        send_S = torch.zeros(self.segment, dtype=self.dtype, device=self.device)
        for slot in self.slots:
            slot.own_rows(send_S).copy_(slot.shard_rows())
        recv_WS = torch.empty(W, self.segment, dtype=self.dtype, device=self.device)
        all_gather_single(recv_WS.view(-1), send_S, group=self.group)
        for slot in self.slots:
            rows_PNQ = slot.in_segments(recv_WS).transpose(0, 1).reshape(slot.P, W * slot.C, slot.Q)
            local_tensor(slot.param).detach().view(slot.P, slot.N, slot.Q).copy_(rows_PNQ[:, :slot.N])
            slot.param.grad = None


class _LocalBucket:
    """A data-parallel group of one rank (experts with edp = 1): no collective and no copy. The
    gradient, divided in place, is the shard's; the shard is the whole parameter (a view), so the
    optimizer has already updated it."""

    def __init__(self, slots: list[_Slot], divide_by: int, reduce_dtype: torch.dtype | None):
        assert all(slot.aliased() for slot in slots), "a one-rank group's shards view their parameters"
        self.slots, self.divide_by, self.reduce_dtype = slots, divide_by, reduce_dtype

    def reduce_scatter(self) -> None:
        for slot in self.slots:
            g = _full_gradient(slot.param)
            slot.set_gradient(g.to(self.reduce_dtype or g.dtype).div_(self.divide_by))

    def all_gather(self) -> None:
        for slot in self.slots:
            slot.param.grad = None


def _runs(slots: list[_Slot], max_segment: int) -> list[list[_Slot]]:
    """Consecutive slots cut into runs whose segments (summed slot sizes) stay within
    `max_segment`; a slot larger than that gets a run of its own."""
    runs: list[list[_Slot]] = [[]]
    for slot in slots:
        if runs[-1] and sum(s.size for s in runs[-1]) + slot.size > max_segment:
            runs.append([])
        runs[-1].append(slot)
    return runs


class ShardModule(nn.Module):
    """The optimizer's parameters: each shard registered under its model parameter's name(s), so
    torch's get/set_optimizer_state_dict key their states as they key the model's (under FSDP or in
    one process) and checkpoints move between the layouts."""

    def __init__(self, model: nn.Module, shards: dict[int, nn.Parameter]):
        super().__init__()
        for name, p in model.named_parameters(remove_duplicate=False):  # tied weights: every name
            if id(p) in shards:
                *path, leaf = name.split(".")
                module: nn.Module = self
                for part in path:
                    if part not in module._modules:
                        module.add_module(part, nn.Module())
                    module = module._modules[part]
                module.register_parameter(leaf, shards[id(p)])


class Zero1DataParallel(DataParallel):
    """`ddp`: full parameters for forward and backward, the optimizer over `ShardModule`'s shards.

    The trainer calls `optimizer_built` once, `reduce_gradients` after each step's last backward and
    `gather_parameters` after each optimizer step. The shards follow the model's parameters whenever
    the model loads a state dict (a load hook), so checkpoints and weights load through the model."""

    def __init__(self, model: nn.Module, layout, grad_dtype: torch.dtype | None = None):
        dims = layout.dims
        self.grad_dtype = grad_dtype
        self.divide_by = dims.dp * dims.cp  # for experts too: parallel/data.py says why
        meshes: dict = {}
        self.kinds = [([_Slot.of(p, mesh, meshes) for p in params if p.requires_grad], mesh)
                      for params, mesh in ((dense_parameters(model), layout.dense_dp_mesh),
                                           (expert_parameters(model), layout.expert_dp_mesh))]
        super().__init__(ShardModule(model, {id(s.param): s.shard for slots, _ in self.kinds for s in slots}))
        self.buckets = self._plan()
        model.register_load_state_dict_post_hook(lambda module, keys: self.take_parameters())

    def _plan(self) -> list:
        """Buckets by (data-parallel group, parameter dtype), at most BUCKET_ELEMENTS each."""
        buckets: list = []
        for slots, mesh in self.kinds:
            by_dtype: dict[torch.dtype, list[_Slot]] = {}
            for slot in slots:
                by_dtype.setdefault(slot.param.dtype, []).append(slot)
            for same_dtype in by_dtype.values():
                if mesh.size() == 1:
                    buckets.append(_LocalBucket(same_dtype, self.divide_by, self.grad_dtype))
                else:
                    buckets += [_Bucket(run, mesh.get_group(), self.divide_by, self.grad_dtype)
                                for run in _runs(same_dtype, BUCKET_ELEMENTS // mesh.size())]
        return buckets

    @torch.no_grad()
    def optimizer_built(self) -> None:
        """The optimizer may have recast its shards (PrecisionAwareAdamW's bf16 masters, whose
        remainders kept the fp32 low bits): the full parameters take the shards' dtypes and values,
        as in one process, the shards view their parameters again, and the buckets are replanned."""
        for slots, _ in self.kinds:
            for slot in slots:
                if slot.param.dtype != slot.shard.dtype:
                    replace_local(slot.param, local_tensor(slot.param).detach().to(slot.shard.dtype))
                if not slot.aliased():  # recast by the optimizer, or a copy from the start
                    slot.rows_of_param().copy_(slot.shard_rows())  # exact: not .to()'s rounding
                    replace_local(slot.shard, slot.rows_as_shard())  # a view again where it can be
        self.buckets = self._plan()
        self.gather_parameters()  # the other ranks' rows

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        for bucket in self.buckets:
            bucket.reduce_scatter()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        for bucket in self.buckets:
            bucket.all_gather()

    @torch.no_grad()
    def take_parameters(self) -> None:
        """Each shard from its full parameter's values (after the model loaded a state dict); those
        that view their parameters have them already."""
        for slots, _ in self.kinds:
            for slot in slots:
                if not slot.aliased():
                    slot.shard_rows().copy_(slot.rows_of_param())
