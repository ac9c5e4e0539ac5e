"""The routed experts' tokens under tensor parallelism: each TP rank dispatches its 1/tp of them.

Routed experts are not TP-sharded, so if every rank of a TP group dispatched the same tokens the
experts would get tp copies of each: tp-fold dispatch traffic and expert compute. Two forms:

- **Sequence parallelism** (`route_sequence_shard`, the main blocks when parallel.sequence_parallel):
  the residual stream already holds 1/tp of each sequence per rank, and the MoE layer takes that
  shard as it is, as Megatron-Core does — no all-gather in or out. The router, the capacity limit
  and the statistics see the rank's own T/tp tokens; the routed counts, the per-sequence counts and
  the statistics' sums add up over the TP group (`SequenceShards`), each rank's balancing losses are
  its share of the group's (moe/balance.py), and the router's gradient (a replicated weight used on
  different tokens) is summed over the group. Shared experts, TP-sharded like a dense MLP,
  all-gather the tokens and reduce-scatter their output.
- **Replicated tokens** (`split_sequence_over_tp`: TP without sequence parallelism, and the MTP
  blocks, which never are): every TP rank holds all T tokens. The router, its statistics and the
  aux losses run on all of them (the same on every rank, no reduction needed), and only the
  dispatched tensors — tokens, combine weights, expert ids, keep mask — are split. Split ↔
  all-gather are each other's backward, so the router and the tokens get their full gradients on
  every TP rank, as replicated computation requires.

T tokens of the TP group, t = T/tp this rank's, K top-k, D model dim.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moefold.errors import ConfigError
from moefold.moe.balance import LocalCounts, SequenceShards
from moefold.moe.replay import WholeBatch
from moefold.moe.router import ReplayedSelection, Router, Routing
from moefold.parallel.collectives import all_gather_single


class _SplitRows(torch.autograd.Function):
    """Forward: this rank's block of rows. Backward: all-gather the blocks' gradients (the input is
    replicated over the group, so its gradient is the concatenation of every rank's block)."""

    @staticmethod
    def forward(ctx, x_T: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x_T.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad_t: torch.Tensor):
        return all_gather_rows(grad_t.contiguous(), ctx.group), None


class GatherBlocks(torch.autograd.Function):
    """Forward: every rank's block all-gathered along `dim`, in rank order, into a new tensor (dim
    0: the MoE tokens' rows; dim 1: a sequence-parallel stream's [B, S/tp, D] shards). Backward:
    this rank's block of the gradient (what follows is replicated computation, so every rank holds
    the same full gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        ranks = all_gather_rows(x.contiguous(), group)  # rank-major along dim 0
        return ranks if dim == 0 else torch.cat(ranks.chunk(dist.get_world_size(group)), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def all_gather_rows(x_t: torch.Tensor, group) -> torch.Tensor:
    out = x_t.new_empty(dist.get_world_size(group) * x_t.shape[0], *x_t.shape[1:])
    all_gather_single(out, x_t, group=group)
    return out


class SequenceSplitDispatcher:
    """Wraps a dispatcher (local or expert-parallel): dispatches this TP rank's 1/tp of the tokens
    and all-gathers the combined outputs. T must divide by tp (checked when the step starts)."""

    def __init__(self, inner, tp_group):
        self.inner, self.group = inner, tp_group
        self.top_k = inner.top_k
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if hasattr(inner, "layout"):  # rows laid out by capacity: the capacity the drop used, of all T
            inner.layout = inner.layout.of_slice(self.tp_size)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor):
        T = x_TD.shape[0]
        if T % self.tp_size:
            raise ConfigError(f"parallel.tp={self.tp_size} does not divide the {T} tokens of a "
                              "micro-batch (train.micro_batch_size · train.seq_len)")
        rows = slice(self.tp_rank * (T // self.tp_size), (self.tp_rank + 1) * (T // self.tp_size))
        mine = dataclasses.replace(routing, probs_TK=_SplitRows.apply(routing.probs_TK, self.group),
                                   idx_TK=routing.idx_TK[rows])
        keep_N = keep_N.view(T, self.top_k)[rows].reshape(-1)  # not view(T, -1): T may be 0
        return self.inner.dispatch(_SplitRows.apply(x_TD, self.group), mine, keep_N)

    def combine(self, y_RD: torch.Tensor, handle) -> torch.Tensor:
        return GatherBlocks.apply(self.inner.combine(y_RD, handle), self.group, 0)


def split_sequence_over_tp(layer, tp_group) -> None:
    """Make `layer` (an MoELayer whose input every TP rank holds whole) dispatch only this TP
    rank's share of its tokens. A layer that already routes a sequence shard is left as it is."""
    if dist.get_world_size(tp_group) > 1 and not isinstance(layer.router, ShardRoutingRouter):
        layer.dispatcher = SequenceSplitDispatcher(layer.dispatcher, tp_group)


# ---------------------------------------------------------------------------------------------
# Sequence parallelism: the layer routes the rank's shard of each sequence
# ---------------------------------------------------------------------------------------------


def route_sequence_shard(layer, tp_mesh: DeviceMesh) -> None:
    """Make `layer` (an MoELayer of a sequence-parallel block, whose input arrives as a DTensor
    sharded along the sequence, Shard(1)) route and dispatch the local shard, returning its output
    as the same DTensor layout. Counts, per-sequence counts and statistics add up over the group;
    the router's gradient is summed over it. (Its shared experts, TP-sharded by apply_tp, gather
    the tokens themselves.)"""
    group = tp_mesh.get_group()
    shards = SequenceShards(group)
    layer.count_routed = LocalCounts(shards)
    layer.balancer.sum_over_shards = shards
    layer.stats.sum_over_shards = shards
    ShardRoutingRouter.convert(layer.router, group)
    rows = SequenceShardRows(group)
    if isinstance(layer.router.select, ReplayedSelection):
        layer.router.select.rows = rows
    layer.router.token_places.rows = rows  # the jitter's places, replay's rows: one layout
    layer.register_forward_pre_hook(lambda module, args: _local_shard(tp_mesh, rows, *args))
    layer.register_forward_hook(
        lambda module, args, y_BtD: DTensor.from_local(y_BtD, tp_mesh, (Shard(1),), run_check=False))


def _local_shard(tp_mesh: DeviceMesh, rows: "SequenceShardRows", x_BSD: DTensor,
                 valid_BS: torch.Tensor | None = None):
    """(x, valid) → this rank's [B, S/tp, D] tokens and the same positions of the [B, S] mask."""
    if valid_BS is not None:  # Replicate → Shard(1) is a local slice, the residual stream's one
        valid_BS = DTensor.from_local(valid_BS, tp_mesh, (Replicate(),), run_check=False)
        valid_BS = valid_BS.redistribute(tp_mesh, (Shard(1),)).to_local()
    x_BtD = x_BSD.to_local()
    rows.shard_len = x_BtD.shape[1]
    return x_BtD, valid_BS


class SequenceShardRows(WholeBatch):
    """Router replay's rows for a router routing this rank's [B, S/tp] shard: a recording holds
    the TP group's whole batch in sequence order ([B, S] flattened, as one process records it; one
    all-gather, while recording only), a replay hands the router its shard's rows of it.
    `shard_len` (S/tp) is set by the layer's input hook before each forward."""

    def __init__(self, group):
        self.group, self.shard_len = group, 0
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def whole(self, idx_tK: torch.Tensor) -> torch.Tensor:
        K = idx_tK.shape[1]
        ranks_tK = all_gather_rows(idx_tK.contiguous(), self.group)  # rank-major: [tp · B·S/tp, K]
        ranks_BsK = ranks_tK.view(self.tp, -1, self.shard_len, K)
        return ranks_BsK.transpose(0, 1).reshape(-1, K)

    def mine(self, idx_TK: torch.Tensor) -> torch.Tensor:
        K = idx_TK.shape[1]
        return idx_TK.view(-1, self.tp, self.shard_len, K)[:, self.rank].reshape(-1, K)

    def whole_tokens(self, num_tokens: int) -> int:
        return num_tokens * self.tp


class ShardRoutingRouter(Router):
    """A router whose TP ranks route different tokens with the same weight: its gradient is summed
    over the TP group where forward reads it (as the QK-norms' under TP, parallel/tensor.py)."""

    group: dist.ProcessGroup

    @classmethod
    def convert(cls, router: Router, group) -> None:
        """In place (class swapped, as FSDP2's fully_shard does): the parameter, buffers, hooks and
        any wrapper build_model put on the instance stay."""
        router.__class__, router.group = cls, group

    def routing_weight(self) -> torch.Tensor:
        return SumGrad.apply(self.weight, self.group)


class SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (Megatron's copy-to-TP-region):
    for a replicated weight whose TP ranks see different tokens, or different heads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


__all__ = ["GatherBlocks", "SequenceSplitDispatcher", "route_sequence_shard", "split_sequence_over_tp"]
