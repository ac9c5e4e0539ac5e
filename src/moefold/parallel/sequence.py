"""Sequence split of the routed experts' tokens over the tensor-parallel ranks.

Under TP every rank of a TP group holds the same tokens (attention and dense layers are sharded by
heads and hidden units, their inputs and outputs replicated). Routed experts are not TP-sharded, so
without a split every TP rank would send the same copies to the experts: tp-fold the dispatch
traffic and expert compute. As in Megatron-Core (which requires sequence parallelism with MoE and
TP), each TP rank dispatches only its own 1/tp of the tokens and the outputs are gathered back.

The router, its statistics and the aux losses still run on all T tokens of the TP group (the same
on every TP rank; T·D·E is small next to the experts), so they need no extra reduction; only the
dispatched tensors — tokens, combine weights, expert ids, keep mask — are split. Autograd:
split ↔ all-gather are each other's backward, so the router and the tokens get their full
gradients on every TP rank, as replicated computation requires.

T tokens of the TP group, t = T/tp this rank's, K top-k, D model dim.
"""

import dataclasses

import torch
import torch.distributed as dist

from moefold.errors import ConfigError
from moefold.moe.router import Routing


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
        return _all_gather_rows(grad_t.contiguous(), ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather every rank's block. Backward: this rank's block of the gradient (what
    follows is replicated computation, so every rank holds the same full gradient)."""

    @staticmethod
    def forward(ctx, x_t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather_rows(x_t.contiguous(), group)

    @staticmethod
    def backward(ctx, grad_T: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad_T.chunk(size)[rank].contiguous(), None


def _all_gather_rows(x_t: torch.Tensor, group) -> torch.Tensor:
    out = x_t.new_empty(dist.get_world_size(group) * x_t.shape[0], *x_t.shape[1:])
    dist.all_gather_into_tensor(out, x_t, group=group)
    return out


class SequenceSplitDispatcher:
    """Wraps a dispatcher (local or expert-parallel): dispatches this TP rank's 1/tp of the tokens
    and all-gathers the combined outputs. T must divide by tp (checked when the step starts)."""

    def __init__(self, inner, tp_group):
        self.inner, self.group = inner, tp_group
        self.top_k = inner.top_k
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor):
        T = x_TD.shape[0]
        if T % self.tp_size:
            raise ConfigError(f"parallel.tp={self.tp_size} does not divide the {T} tokens of a "
                              "micro-batch (train.micro_batch_size · train.seq_len)")
        rows = slice(self.tp_rank * (T // self.tp_size), (self.tp_rank + 1) * (T // self.tp_size))
        mine = dataclasses.replace(routing, probs_TK=_SplitRows.apply(routing.probs_TK, self.group),
                                   idx_TK=routing.idx_TK[rows])
        keep_N = keep_N.view(T, -1)[rows].reshape(-1)
        return self.inner.dispatch(_SplitRows.apply(x_TD, self.group), mine, keep_N)

    def combine(self, y_RD: torch.Tensor, handle) -> torch.Tensor:
        return _GatherRows.apply(self.inner.combine(y_RD, handle), self.group)


def split_sequence_over_tp(layer, tp_group) -> None:
    """Make `layer` (an MoELayer) dispatch only this TP rank's share of its tokens."""
    if dist.get_world_size(tp_group) > 1:
        layer.dispatcher = SequenceSplitDispatcher(layer.dispatcher, tp_group)


__all__ = ["SequenceSplitDispatcher", "split_sequence_over_tp"]
