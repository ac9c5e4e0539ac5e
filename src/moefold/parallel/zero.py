"""ZeRO-1 for `parallel.data_parallel = ddp`: parameters replicated, optimizer states sharded.

Forward and backward read the model's full parameters, replicated over the data ranks as in plain
DDP. After the step's last backward the gradients are reduce-scattered over their data-parallel
group (dense over dp·cp, experts over edp, both divided by dp·cp: parallel/data.py says why), so a
rank receives the averaged gradient of its own shard only. The optimizer holds only those shards and
keeps states for them (moments, PrecisionAwareAdamW's master remainders); after its step the updated
shards are all-gathered back into the full parameters. As Megatron-Core's distributed optimizer and
TorchTitan's DDP: states cost 1/dp·cp (dense) or 1/edp (experts) per rank, at the communication
volume of one all-reduce (a reduce-scatter plus an all-gather).

Shards are DTensors. A parameter's shard adds a `Shard(d)` over the data-parallel mesh to its own
placements (TP, EP/ETP, or none), on the first tensor dim those leave whole: dense matrices and
norms their rows (dim 0), column-parallel TP weights dim 1, experts [E, D, F] under EP dim 1; uneven
sizes as torch.chunk. The data mesh comes last, so were every dim already split the data ranks
would split this rank's piece further (DTensor's nested Shard). Being ordinary sharded tensors:
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

from moefold.optim.precision import replace_local
from moefold.parallel.data import DataParallel, dense_parameters, expert_parameters
from moefold.parallel.local import local_tensor

BUCKET_ELEMENTS = 2 ** 26
"""Elements (all ranks' segments) of one bucket: bounds the flat buffers' extra memory (256 MiB
of fp32) while keeping collectives few (Megatron-Core's buckets are of a similar size)."""

# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single; older torch (the GPU
# machine's 2.11) has only the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_dim(p: torch.Tensor) -> int:
    """The first dim of `p` its own placements leave whole; 0 when they split every one."""
    taken = {pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()}
    return next((d for d in range(p.dim()) if d not in taken), 0)


def _make_shard(p: nn.Parameter, dp_mesh: DeviceMesh, meshes: dict) -> nn.Parameter:
    """This rank's rows of `p`: a DTensor over `p`'s own mesh followed by `dp_mesh`."""
    if p.dim() == 0:
        raise ValueError("parallel.data_parallel=ddp (ZeRO-1) cannot shard a 0-dim parameter")
    d = shard_dim(p)
    own = p.device_mesh if isinstance(p, DTensor) else None
    key = (own, dp_mesh)
    if key not in meshes:  # DeviceMesh._concatenate is private; FSDP2 builds its 2-D meshes with it
        meshes[key] = dp_mesh if own is None else DeviceMesh._concatenate([own, dp_mesh])
    placements = (*getattr(p, "placements", ()), Shard(d))
    local = local_tensor(p).detach()
    size, offset = Shard.local_shard_size_and_offset(local.shape[d], dp_mesh.size(), dp_mesh.get_local_rank())
    rows = local.narrow(d, offset, size).clone(memory_format=torch.contiguous_format)
    return nn.Parameter(DTensor.from_local(rows, meshes[key], placements, run_check=False,
                                           shape=p.shape, stride=p.stride()),
                        requires_grad=p.requires_grad)


@dataclass
class _Slot:
    """One parameter in a bucket: this rank holds rows [row0, row0 + rows) of its [P, N, Q] local
    piece; in every segment the parameter takes P·C·Q elements from `offset`."""
    param: nn.Parameter  # the model's, full
    shard: nn.Parameter  # the optimizer's
    P: int
    N: int
    Q: int
    C: int
    row0: int
    rows: int
    offset: int = 0

    @classmethod
    def of(cls, param: nn.Parameter, shard: nn.Parameter, world: int, rank: int) -> _Slot:
        shape, d = local_tensor(param).shape, shard.placements[-1].dim
        n = shape[d]
        rows, row0 = Shard.local_shard_size_and_offset(n, world, rank)
        return cls(param, shard, math.prod(shape[:d]), n, math.prod(shape[d + 1:]), -(-n // world),
                   row0, rows)

    @property
    def size(self) -> int:
        return self.P * self.C * self.Q

    def in_segments(self, buf_WS: torch.Tensor) -> torch.Tensor:
        """[W, P, C, Q]: the parameter's slot in every rank's segment."""
        return buf_WS[:, self.offset:self.offset + self.size].view(-1, self.P, self.C, self.Q)

    def own_rows(self, buf_S: torch.Tensor) -> torch.Tensor:
        """[P, rows, Q]: this rank's rows in its own segment."""
        return buf_S[self.offset:self.offset + self.size].view(self.P, self.C, self.Q)[:, :self.rows]

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """[P, rows, Q]: this rank's rows of a full local piece."""
        return full.view(self.P, self.N, self.Q)[:, self.row0:self.row0 + self.rows]

    def shard_local(self) -> torch.Tensor:
        return local_tensor(self.shard).detach().view(self.P, self.rows, self.Q)


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
        self.device = slots[0].shard.device

    def reduce_scatter(self) -> None:
        """Each slot's averaged gradient rows become its shard's gradient, which the model's
        parameter also shows (a DTensor: full_tensor() gathers the whole average); the full
        gradients are freed as they are copied in."""
        W = self.world
        send_WS = torch.zeros(W, self.segment, dtype=self.reduce_dtype, device=self.device)
        for slot in self.slots:
            g_PNQ = _full_gradient(slot.param).reshape(slot.P, slot.N, slot.Q)
            padded = F.pad(g_PNQ, (0, 0, 0, W * slot.C - slot.N))
            slot.in_segments(send_WS).copy_(padded.view(slot.P, W, slot.C, slot.Q).transpose(0, 1))
            slot.param.grad = None
        recv_S = torch.empty(self.segment, dtype=self.reduce_dtype, device=self.device)
        _reduce_scatter(recv_S, send_WS.view(-1), group=self.group)
        recv_S.div_(self.divide_by)
        for slot in self.slots:
            s = slot.shard
            rows = slot.own_rows(recv_S).to(s.dtype).reshape(local_tensor(s).shape)
            s.grad = DTensor.from_local(rows, s.device_mesh, s.placements, run_check=False,
                                        shape=s.shape, stride=s.stride())
            slot.param.grad = s.grad

    def all_gather(self) -> None:
        """Every rank's updated rows into the full parameters; their gradients (the shards') are
        dropped so that the next backward starts afresh."""
        W = self.world
        send_S = torch.zeros(self.segment, dtype=self.dtype, device=self.device)
        for slot in self.slots:
            slot.own_rows(send_S).copy_(slot.shard_local())
        recv_WS = torch.empty(W, self.segment, dtype=self.dtype, device=self.device)
        dist.all_gather_into_tensor(recv_WS.view(-1), send_S, group=self.group)
        for slot in self.slots:
            rows_PNQ = slot.in_segments(recv_WS).transpose(0, 1).reshape(slot.P, W * slot.C, slot.Q)
            local_tensor(slot.param).detach().view(slot.P, slot.N, slot.Q).copy_(rows_PNQ[:, :slot.N])
            slot.param.grad = None


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
        self.kinds = [([p for p in params if p.requires_grad], mesh) for params, mesh in
                      ((dense_parameters(model), layout.dense_dp_mesh),
                       (expert_parameters(model), layout.expert_dp_mesh))]
        self.divide_by = dims.dp * dims.cp  # for experts too: parallel/data.py says why
        meshes: dict = {}
        self.shards = {id(p): _make_shard(p, mesh, meshes) for params, mesh in self.kinds for p in params}
        super().__init__(ShardModule(model, self.shards))
        self.buckets = self._plan()
        model.register_load_state_dict_post_hook(lambda module, keys: self.take_parameters())

    def _plan(self) -> list[_Bucket]:
        """Buckets by (data-parallel group, parameter dtype), at most BUCKET_ELEMENTS each."""
        buckets = []
        for params, mesh in self.kinds:
            world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
            by_dtype: dict[torch.dtype, list[list[_Slot]]] = {}
            for p in params:
                slot = _Slot.of(p, self.shards[id(p)], world, rank)
                runs = by_dtype.setdefault(p.dtype, [[]])
                if runs[-1] and world * (sum(s.size for s in runs[-1]) + slot.size) > BUCKET_ELEMENTS:
                    runs.append([])
                runs[-1].append(slot)
            buckets += [_Bucket(slots, group, self.divide_by, self.grad_dtype)
                        for runs in by_dtype.values() for slots in runs]
        return buckets

    @torch.no_grad()
    def optimizer_built(self) -> None:
        """The optimizer may have recast its shards (PrecisionAwareAdamW's bf16 masters, whose
        remainders kept the fp32 low bits): the full parameters take the shards' dtypes and values,
        as in one process, and the buckets are planned again."""
        for params, _ in self.kinds:
            for p in params:
                shard = self.shards[id(p)]
                if p.dtype != shard.dtype:
                    replace_local(p, local_tensor(p).detach().to(shard.dtype))
        self.buckets = self._plan()
        self.gather_parameters()

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
        """Each shard from its full parameter's values (after the model loaded a state dict)."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.shard_local().copy_(slot.rows_of(local_tensor(slot.param).detach()))
