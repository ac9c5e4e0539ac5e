"""Expert parallelism: each rank of the EP group holds E/ep experts; routed copies travel to them
by all-to-all and back.

T tokens, K top-k, N = T·K routed copies, D model dim, E experts (global), L = E/ep local experts,
P ep ranks, S rows this rank sends (its kept copies), R rows it receives.

`AllToAllDispatcher` keeps the `LocalDispatcher` interface, so `MoELayer` does not change; its
phases (preprocess → communicate → postprocess, and the reverse for combine) are small methods
whose state passes in the handle, so a scheduler can later overlap communication with compute.
`AllGatherDispatcher` is the host-sync-free alternative: every rank gathers all ranks' tokens and
routing, computes the copies routed to its experts and reduce-scatters the outputs back (more
traffic, P·T·D each way, but static shapes and no device→host copy). With a capacity factor each
rank drops its own copies before dispatch (moe/capacity.py), so both take it; with
`moe.pad_to_capacity`, `CapacityAllToAllDispatcher` sends every expert exactly C rows from every
rank: equal splits, static shapes, no device→host copy. `apply_ep` turns a built, single-process
`MoELayer` into the EP one in place, with the dispatcher its name and the layer's row layout pick.

For the all-gather dispatcher: G = P·T gathered tokens, M = G·K gathered copies; its expert buffer
has M rows (static), this rank's copies first, grouped by local expert.

Rows go out sorted by global expert, hence grouped by destination rank (experts are contiguous
blocks by rank: rank p holds experts p·L .. p·L+L-1); they arrive grouped by source rank, then by
local expert, and are regrouped by local expert for the grouped GEMM.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moefold.config import refuse_padded_capacity_without_alltoall
from moefold.errors import ConfigError
from moefold.moe.dispatch import (
    Dispatched,
    LocalDispatcher,
    _sum_copies,
    _weighted_sum_copies,
)
from moefold.moe.layer import MoELayer
from moefold.moe.permute import (
    PermutePlan,
    RowLayout,
    gather_rows,
    permute,
    plan_permutation,
    row_probs,
    unpermute,
)
from moefold.moe.router import Routing
from moefold.parallel.collectives import all_gather_single, reduce_scatter_single, reduce_scatter_single_autograd
from moefold.parallel.dims import expert_coords
from moefold.parallel.local import DeviceCopies
from moefold.parallel.sequence import all_gather_rows


@dataclass
class AllToAllHandle:
    order_N: torch.Tensor  # int64: copies sorted by global expert (kept first, dropped last)
    position_N: torch.Tensor  # int64: each copy's place in that order (the inverse of order_N)
    keep_N: torch.Tensor  # bool: the copy was sent
    regrouped: "SortedRegroup | PaddedRegroup"  # how the received rows were grouped by expert
    send_per_ep: list[int]  # kept copies for each EP index (host)
    send_splits: list[int]  # rows sent to each group rank (host)
    recv_splits: list[int]  # rows received from each group rank (host)
    probs_TK: torch.Tensor  # combine weights, used when the experts did not apply them


@dataclass
class _Sorted:
    """preprocess → communicate: this rank's copies sorted by global expert (kept ones first)."""
    x_SD: torch.Tensor
    probs_S: torch.Tensor


def _inverse(permutation_N: torch.Tensor) -> torch.Tensor:
    """inverse[permutation[i]] = i."""
    N = permutation_N.numel()
    return torch.empty_like(permutation_N).scatter_(0, permutation_N, torch.arange(N, device=permutation_N.device))


class _HostCopy:
    """A device→host copy started now and read later: into pinned memory behind an event on CUDA
    (the host goes on launching work until `tolist`), a plain read elsewhere."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _ExpertParallelDispatcher:
    """What both EP dispatchers share: the group, this rank's block of E/ep experts, and how
    combine sums a token's K copies (plain when the experts applied the probabilities).

    `group` is the EP group, or with expert tensor parallelism the EP×ETP group; `ep_of_rank[g]` is
    the EP index of group rank g (None: group rank = EP index, no ETP). Ranks that share an EP index
    hold the same experts, each a slice of their hidden dimension, and each gets every copy routed
    to those experts: their partial outputs add up in combine."""

    def __init__(self, top_k: int, num_experts: int, group, probs_applied_by_experts: bool,
                 ep_of_rank: list[int] | None = None, pad_multiple: int = 1):
        self.top_k, self.num_experts, self.group = top_k, num_experts, group
        self.pad_multiple = pad_multiple
        self.group_size = dist.get_world_size(group)
        self.ep_of_rank = ep_of_rank or list(range(self.group_size))
        self.ep_size, self.ep_rank = len(set(self.ep_of_rank)), self.ep_of_rank[dist.get_rank(group)]
        if num_experts % self.ep_size:
            raise ConfigError(f"parallel.ep={self.ep_size} does not divide "
                              f"moe.num_experts={num_experts}")
        self.num_local_experts = num_experts // self.ep_size
        self._fans_out = self.ep_of_rank != list(range(self.ep_size))
        self._device_copies = DeviceCopies()  # ep_of_rank as an index tensor
        self._reduce = _sum_copies if probs_applied_by_experts else _weighted_sum_copies

    GROUPINGS: tuple[type, type]  # how received rows are grouped by local expert: without, with padding
    UNEVEN_TOKENS_HINT = ""  # what a dispatcher that needs the same T on every rank suggests instead

    @property
    def grouping(self) -> type:
        return self.GROUPINGS[self.pad_multiple > 1]

    def _check_same_num_tokens(self, T: int, device) -> None:
        """One 2-element all-reduce and a device-side assert (no host sync on CUDA), for the
        dispatchers whose shapes assume every rank has the same T: exchanging unequal sizes
        would be undefined (NCCL reads or writes out of bounds, or hangs)."""
        bounds = torch.full((2,), T, dtype=torch.int64, device=device)
        bounds[1].neg_()
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)  # max T, −min T
        torch._assert_async(bounds.sum() == 0,
                            f"{type(self).__name__} needs the same number of tokens (batch·sequence) "
                            f"on every EP rank; this rank has {T} and another differs "
                            f"({self.UNEVEN_TOKENS_HINT})")

    def _all_to_all(self, x: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None) -> torch.Tensor:
        # The functional all-to-all is autograd-aware: backward runs the reverse exchange.
        y = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group=self.group)
        return funcol.wait_tensor(y)

    def _fan_out(self, x_S: torch.Tensor, send_per_ep: list[int]) -> torch.Tensor:
        """The rows for each group rank, in group order: with ETP, each EP index's rows once per
        ETP rank of it (autograd sums the copies' gradients)."""
        if not self._fans_out:
            return x_S
        chunks = x_S.split(send_per_ep)
        return torch.cat([chunks[p] for p in self.ep_of_rank])

    def _fan_in(self, y_X: torch.Tensor, send_splits: list[int]) -> torch.Tensor:
        """Inverse of `_fan_out`: sum the ETP ranks' partial outputs of each EP index's rows."""
        if not self._fans_out:
            return y_X
        per_ep: list[torch.Tensor | None] = [None] * self.ep_size
        for p, piece in zip(self.ep_of_rank, y_X.split(send_splits)):
            per_ep[p] = piece if per_ep[p] is None else per_ep[p] + piece
        return torch.cat(per_ep)


class SortedRegroup:
    """Received rows grouped by local expert as they are: a stable sort, its inverse for combine."""

    def __init__(self, regroup_R: torch.Tensor, rows_per_expert_L: torch.Tensor):
        self.regroup_R, self.inverse_R = regroup_R, _inverse(regroup_R)
        self.rows_per_expert_L = rows_per_expert_L

    @classmethod
    def of(cls, expert_of_row_R, rows_per_expert_L, pad_multiple: int) -> "SortedRegroup":
        return cls(torch.argsort(expert_of_row_R, stable=True), rows_per_expert_L)

    def apply(self, x_RD, probs_R):
        x_RD = gather_rows(x_RD, self.regroup_R, self.inverse_R[:, None])
        return x_RD, probs_R.index_select(0, self.regroup_R)

    def undo(self, y_RD):
        R = self.regroup_R.numel()
        return gather_rows(y_RD[:R], self.inverse_R, self.regroup_R[:, None])


class PaddedRegroup:
    """Received rows grouped by local expert, each expert's group padded with zero rows to a
    multiple of `pad_multiple` (the FP8 kernels' alignment): the local static-shape permutation's
    plan (moe/permute.py) with one copy per row: Y = R + L·(multiple − 1) rows (no sync for the
    size). Padding rows get probability 0 and no gradient."""

    def __init__(self, plan: PermutePlan):
        self.plan, self.rows_per_expert_L = plan, plan.rows_per_expert_E

    @classmethod
    def of(cls, expert_of_row_R, rows_per_expert_L, pad_multiple: int) -> "PaddedRegroup":
        layout = RowLayout(rows_per_expert_L.numel(), 1, pad_multiple)
        keep_R = torch.ones_like(expert_of_row_R, dtype=torch.bool)
        return cls(plan_permutation(expert_of_row_R[:, None], keep_R, layout))

    def apply(self, x_RD, probs_R):
        # Padding rows read an appended zero row, so the gathers have a row to read even when this
        # rank received none (R = 0) and the result still depends on x_RD: backward then reaches
        # the all-to-all on every rank.
        plan, R = self.plan, x_RD.shape[0]  # plan.copy_of_row_R and row_valid_R have Y entries
        index_Y = torch.where(plan.row_valid_R, plan.copy_of_row_R, R)
        back_R1 = torch.cat([plan.row_of_copy_N, plan.row_of_copy_N.new_zeros(1)])[:, None]
        sent_R1 = torch.arange(R + 1, device=x_RD.device)[:, None] < R
        x_R1D = torch.cat([x_RD, x_RD.new_zeros(1, x_RD.shape[-1])])
        probs_R1 = torch.cat([probs_R, probs_R.new_zeros(1)])
        return (gather_rows(x_R1D, index_Y, back_R1, plan.row_valid_R, sent_R1),
                probs_R1.index_select(0, index_Y))

    def undo(self, y_YD):
        # One spare output row past the R received ones, for the padding rows' gradients to read
        # (backward gathers from the output, which has no rows when R = 0); zero, and cut off.
        plan, R = self.plan, self.plan.row_of_copy_N.numel()
        index_R1 = torch.cat([plan.row_of_copy_N, plan.row_of_copy_N.new_zeros(1)])
        valid_R1 = torch.arange(R + 1, device=y_YD.device) < R
        back_Y = torch.where(plan.row_valid_R, plan.copy_of_row_R, R)[:, None]
        return gather_rows(y_YD, index_R1, back_Y, valid_R1, plan.row_valid_R[:, None])[:R]


class AllToAllDispatcher(_ExpertParallelDispatcher):
    """Dropless all-to-all dispatch over `ep_group` (Megatron-Core's MoEAlltoAllTokenDispatcher).

    One device→host copy per layer call: the split sizes the all-to-all needs on the host. Tokens and
    their routing probabilities travel through the autograd-aware all-to-all, so backward runs the
    reverse exchanges and the router gets its gradient through the experts (memory-efficient path)
    or through combine (otherwise).
    """

    GROUPINGS = (SortedRegroup, PaddedRegroup)  # of the received rows: without, with padding

    # ------------------------------------------------------------------------------- dispatch

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        order_N, tokens_per_expert_E = self._sort_copies(routing, keep_N)
        counts_GL, splits = self._exchange_counts(tokens_per_expert_E)  # host copy issued early ...
        position_N = _inverse(order_N)
        sorted_ = self._gather_sorted(x_TD, routing, order_N, position_N)  # ... the permutation ...
        send_per_ep, send_splits, recv_splits = self._split_sizes(splits)  # ... waited for late
        x_RD, probs_R = self._communicate(sorted_, send_per_ep, send_splits, recv_splits)
        x_RD, probs_R, rows_per_expert_L, regrouped = self._postprocess(x_RD, probs_R, counts_GL)
        handle = AllToAllHandle(order_N, position_N, keep_N, regrouped, send_per_ep,
                                send_splits, recv_splits, routing.probs_TK)
        return Dispatched(x_RD=x_RD, rows_per_expert_E=rows_per_expert_L, probs_R=probs_R, handle=handle)

    def _sort_copies(self, routing: Routing, keep_N) -> tuple[torch.Tensor, torch.Tensor]:
        """The copies' order sorted by global expert (stable: token order within an expert; dropped
        copies, i.e. padding tokens, get key E and sort last, past the rows that are sent) and the
        copies per expert."""
        E = self.num_experts
        key_N = torch.where(keep_N, routing.idx_TK.reshape(-1), E)
        order_N = torch.argsort(key_N, stable=True)
        counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=key_N.device)
        counts_E1.scatter_add_(0, key_N, torch.ones_like(key_N))
        return order_N, counts_E1[:E]

    def _exchange_counts(self, tokens_per_expert_E: torch.Tensor):
        """Counts all-to-all over the group (G ranks, P·ETP; every ETP rank of an EP index gets that
        index's copies), then the split sizes' device→host copy, started but not waited for."""
        P, L = self.ep_size, self.num_local_experts
        counts_PL = tokens_per_expert_E.view(P, L)
        # Copied once: a copy per call waited for the stream before the split sizes' copy was issued.
        ep_of_rank_G = self._device_copies.on(counts_PL.device, "ep_of_rank", lambda: self.ep_of_rank)
        # counts_GL[g, l]: rows group rank g sends to this rank's local expert l.
        counts_GL = torch.empty(self.group_size * L, dtype=counts_PL.dtype, device=counts_PL.device)
        dist.all_to_all_single(counts_GL, counts_PL.index_select(0, ep_of_rank_G).reshape(-1),
                               group=self.group)
        counts_GL = counts_GL.view(-1, L)
        return counts_GL, _HostCopy(torch.cat([counts_PL.sum(1), counts_GL.sum(1)]))

    def _gather_sorted(self, x_TD, routing: Routing, order_N, position_N) -> _Sorted:
        """Backward gathers each token's K copies back through position_N (no scatter-add)."""
        return _Sorted(x_SD=gather_rows(x_TD, order_N // self.top_k, position_N.view(-1, self.top_k)),
                       probs_S=routing.probs_TK.reshape(-1).index_select(0, order_N))

    def _split_sizes(self, splits: _HostCopy) -> tuple[list[int], list[int], list[int]]:
        """(rows for each EP index, rows sent to / received from each group rank) on the host."""
        sizes = splits.tolist()  # HOST SYNC: all_to_all needs split sizes on the host
        send_per_ep, recv_splits = sizes[:self.ep_size], sizes[self.ep_size:]
        return send_per_ep, [send_per_ep[p] for p in self.ep_of_rank], recv_splits

    def _communicate(self, s: _Sorted, send_per_ep, send_splits, recv_splits):
        """Tokens and their probabilities by the autograd-aware uneven all-to-all."""
        S = sum(send_per_ep)
        x_RD = self._all_to_all(self._fan_out(s.x_SD[:S], send_per_ep), recv_splits, send_splits)
        probs_R = self._all_to_all(self._fan_out(s.probs_S[:S], send_per_ep), recv_splits, send_splits)
        return x_RD, probs_R

    def _postprocess(self, x_RD, probs_R, counts_PL):
        """Regroup the received rows (source-major) by local expert, stable within a source."""
        P, L = counts_PL.shape
        local_expert_PL = torch.arange(L, device=counts_PL.device).repeat(P)
        # output_size given: no host sync for repeat_interleave's result size.
        expert_of_row_R = local_expert_PL.repeat_interleave(counts_PL.reshape(-1), output_size=x_RD.shape[0])
        regrouped = self.grouping.of(expert_of_row_R, counts_PL.sum(0), self.pad_multiple)
        return (*regrouped.apply(x_RD, probs_R), regrouped.rows_per_expert_L, regrouped)

    # -------------------------------------------------------------------------------- combine

    def combine(self, y_RD: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies is done in fp32)."""
        y_RD = self._combine_preprocess(y_RD, handle)
        y_XD = self._all_to_all(y_RD, handle.send_splits, handle.recv_splits)
        return self._combine_postprocess(self._fan_in(y_XD, handle.send_splits), handle)

    def _combine_preprocess(self, y_RD, handle: AllToAllHandle):
        """Undo the regrouping: back to source-major order."""
        return handle.regrouped.undo(y_RD)

    def _combine_postprocess(self, y_SD, handle: AllToAllHandle):
        """Un-sort into copy order (a gather; zeros for dropped copies) and sum the K copies."""
        # Kept copies sit at positions < S; dropped ones read an appended zero row (index S), so the
        # result always depends on y_SD and backward reaches the all-to-all on every rank. Backward
        # gathers each sent row's gradient from its copy (the zero row's from none).
        S = y_SD.shape[0]
        y_S1D = torch.cat([y_SD, y_SD.new_zeros(1, y_SD.shape[-1])])
        copy_of_row_S1 = torch.cat([handle.order_N[:S], handle.order_N.new_zeros(1)])
        sent_S1 = torch.arange(S + 1, device=y_SD.device) < S
        y_ND = gather_rows(y_S1D, torch.where(handle.keep_N, handle.position_N, S),
                           copy_of_row_S1[:, None], back_valid_XC=sent_S1[:, None])
        return self._reduce(y_ND.view(-1, self.top_k, y_SD.shape[-1]), handle.probs_TK)


@dataclass
class CapacityHandle:
    plan: PermutePlan  # this rank's copies in E groups of exactly C rows (the capacity layout)
    send_splits: list[int]  # rows sent to each group rank: L·C each
    probs_TK: torch.Tensor  # combine weights, used when the experts did not apply them


class CapacityAllToAllDispatcher(_ExpertParallelDispatcher):
    """All-to-all dispatch with every expert's rows padded to its capacity (`moe.pad_to_capacity`;
    Megatron-Core's drop-and-pad): static shapes and no host sync.

    Each rank has dropped its copies past C, the capacity of its own T tokens (moe/capacity.py, as
    without EP), and lays the rest out as E groups of exactly C rows (the local dispatcher's
    capacity layout, padding rows zero). Every group rank then gets L·C rows for each of its EP
    index's L experts from every rank — equal splits, known without a device→host copy — and a
    transpose regroups the G·L·C received rows (source-major) by local expert: G·C rows each,
    padding included. Needs the same T on every rank of the group, so that all agree on C (checked
    on the device)."""

    UNEVEN_TOKENS_HINT = "use moe.pad_to_capacity=false for uneven token counts"

    def __init__(self, top_k: int, num_experts: int, group, probs_applied_by_experts: bool,
                 layout: RowLayout, ep_of_rank: list[int] | None = None):
        super().__init__(top_k, num_experts, group, probs_applied_by_experts, ep_of_rank,
                         pad_multiple=layout.multiple)
        self.layout = layout  # RowLayout(E, K, pad_multiple, capacity_of): C rows per expert

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        self._check_same_num_tokens(x_TD.shape[0], keep_N.device)
        plan = plan_permutation(routing.idx_TK, keep_N, self.layout)
        x_SD, probs_S = permute(x_TD, plan, self.top_k), row_probs(routing.probs_TK, plan)  # S = E·C
        rows_per_ep = x_SD.shape[0] // self.ep_size  # L·C for every EP index
        x_RD, probs_R = (self._to_experts(self._send(t, rows_per_ep)) for t in (x_SD, probs_S))
        rows_per_expert_L = torch.full((self.num_local_experts,), x_RD.shape[0] // self.num_local_experts,
                                       dtype=torch.int64, device=x_RD.device)
        return Dispatched(x_RD=x_RD, rows_per_expert_E=rows_per_expert_L, probs_R=probs_R,
                          handle=CapacityHandle(plan, [rows_per_ep] * self.group_size, routing.probs_TK))

    def combine(self, y_RD: torch.Tensor, handle: CapacityHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies is done in fp32)."""
        y_XD = self._all_to_all(self._from_experts(y_RD), None, None)
        y_SD = self._fan_in(y_XD, handle.send_splits)
        return self._reduce(unpermute(y_SD, handle.plan, self.top_k), handle.probs_TK)

    def _send(self, x_S: torch.Tensor, rows_per_ep: int) -> torch.Tensor:
        """Each EP index's rows to each of its group ranks: equal splits, none read on the host."""
        return self._all_to_all(self._fan_out(x_S, [rows_per_ep] * self.ep_size), None, None)

    def _to_experts(self, x_R: torch.Tensor) -> torch.Tensor:
        """[G, L, C] (as received, source-major) → [L, G, C] (grouped by local expert)."""
        G, L = self.group_size, self.num_local_experts
        return x_R.view(G, L, -1, *x_R.shape[1:]).transpose(0, 1).reshape(x_R.shape)

    def _from_experts(self, y_R: torch.Tensor) -> torch.Tensor:
        G, L = self.group_size, self.num_local_experts
        return y_R.view(L, G, -1, *y_R.shape[1:]).transpose(0, 1).reshape(y_R.shape)


@dataclass
class AllGatherHandle:
    buffer: "SortedBuffer | PaddedBuffer"  # where each gathered copy sits in the expert buffer
    probs_GK: torch.Tensor  # gathered combine weights, used when the experts did not apply them


class SortedBuffer:
    """The gathered copies sorted by local expert (stable), M rows: this rank's first, the rest
    (other ranks' experts, dropped copies) after the last group as zeros, never computed."""

    def __init__(self, key_M: torch.Tensor, local_M: torch.Tensor, num_local_experts: int, top_k: int,
                 pad_multiple: int):
        L, M = num_local_experts, key_M.numel()
        self.top_k, self.local_M = top_k, local_M
        self.order_M = torch.argsort(key_M, stable=True)
        counts_L1 = torch.zeros(L + 1, dtype=torch.int64, device=key_M.device)
        counts_L1.scatter_add_(0, key_M, torch.ones_like(key_M))
        self.rows_per_expert_L = counts_L1[:L]
        self.row_valid_R = local_M.index_select(0, self.order_M)  # R = M rows
        self.position_M = torch.empty_like(self.order_M).scatter_(
            0, self.order_M, torch.arange(M, device=key_M.device))

    def fill(self, x_GD, probs_GK):
        # Zeros (not other ranks' tokens) in the unused rows, so no gradient flows through them.
        x_RD = torch.where(self.row_valid_R[:, None], x_GD.index_select(0, self.order_M // self.top_k), 0)
        probs_R = torch.where(self.row_valid_R, probs_GK.reshape(-1).index_select(0, self.order_M), 0)
        return x_RD, probs_R

    def copies(self, y_RD):
        """Each gathered copy's output [G, K, D]; `torch.where` keeps whatever the experts left in
        unused rows, even NaN, out."""
        y_MD = torch.where(self.local_M[:, None], y_RD.index_select(0, self.position_M), 0)
        return y_MD.view(-1, self.top_k, y_RD.shape[-1])


class PaddedBuffer:
    """The gathered copies of this rank's experts grouped by local expert, each group padded with
    zero rows to a multiple of `pad_multiple` (FP8 experts): the local permutation (moe/permute.py)
    of the gathered tokens, other ranks' copies dropped. M + L·(multiple − 1) rows."""

    def __init__(self, key_M: torch.Tensor, local_M: torch.Tensor, num_local_experts: int, top_k: int,
                 pad_multiple: int):
        self.top_k = top_k
        layout = RowLayout(num_local_experts, top_k, pad_multiple)
        self.plan = plan_permutation(key_M.view(-1, top_k), local_M, layout)
        self.rows_per_expert_L = self.plan.rows_per_expert_E

    def fill(self, x_GD, probs_GK):
        return permute(x_GD, self.plan, self.top_k), row_probs(probs_GK, self.plan)

    def copies(self, y_RD):
        return unpermute(y_RD, self.plan, self.top_k)


class _GatherRowsSumGrad(torch.autograd.Function):
    """Forward: every rank's rows all-gathered in rank order. Backward: the gradient summed over the
    group, this rank's rows kept (a reduce-scatter): each rank's copy fed its own experts.
    torch.distributed.nn.functional.all_gather does this on NCCL, but on gloo its backward scatters
    with `src` a group rank where torch takes a global one (torch 2.13), so on any group but the
    world's first ranks it fails ("Global rank 0 is not part of group")."""

    @staticmethod
    def forward(ctx, x_T: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_rows(x_T.contiguous(), group)

    @staticmethod
    def backward(ctx, grad_G: torch.Tensor):
        grad_T = grad_G.new_empty(grad_G.shape[0] // dist.get_world_size(ctx.group), *grad_G.shape[1:])
        reduce_scatter_single(grad_T, grad_G.contiguous(), group=ctx.group)
        return grad_T, None


@dataclass
class _Gathered:
    """communicate → postprocess: every rank's tokens and routing, in rank order."""
    x_GD: torch.Tensor
    key_M: torch.Tensor  # int64: global expert of each copy; E for dropped copies
    probs_GK: torch.Tensor


class AllGatherDispatcher(_ExpertParallelDispatcher):
    """All-gather dispatch over `ep_group` (Megatron-Core's MoEAllGatherTokenDispatcher), no host sync.

    Every rank gathers all ranks' tokens, expert ids and probabilities (the probabilities and tokens
    through the autograd-aware all-gather, so backward reduce-scatters their gradients), sorts the
    gathered copies so its own experts' come first, runs them, and reduce-scatters the outputs: each
    copy is computed on exactly one rank, so the sum over the group completes every token's sum over
    its K copies. Needs the same T on every EP rank (static sequence lengths); checked on the device.
    """

    GROUPINGS = (SortedBuffer, PaddedBuffer)  # of the expert buffer: without, with padding
    UNEVEN_TOKENS_HINT = "parallel.ep_dispatcher='alltoall' (apply_ep's dispatcher) takes uneven token counts"

    # ------------------------------------------------------------------------------- dispatch

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        key_N = self._preprocess(x_TD, routing, keep_N)
        gathered = self._communicate(x_TD, key_N, routing.probs_TK)
        return self._postprocess(gathered)

    def _preprocess(self, x_TD, routing: Routing, keep_N) -> torch.Tensor:
        """Check that every rank has the same T; dropped copies (padding tokens) get key E."""
        self._check_same_num_tokens(x_TD.shape[0], keep_N.device)
        return torch.where(keep_N, routing.idx_TK.reshape(-1), self.num_experts)

    def _communicate(self, x_TD, key_N, probs_TK) -> _Gathered:
        """Tokens and probabilities by the autograd-aware all-gather; expert ids need no gradient."""
        key_M = key_N.new_empty(self.group_size * key_N.numel())
        all_gather_single(key_M, key_N.contiguous(), group=self.group)
        return _Gathered(x_GD=_GatherRowsSumGrad.apply(x_TD, self.group), key_M=key_M,
                         probs_GK=_GatherRowsSumGrad.apply(probs_TK, self.group))

    def _postprocess(self, g: _Gathered) -> Dispatched:
        """Static-shape grouping by local expert (stable: gathered order within an expert); copies
        for other ranks' experts and dropped ones get key L: never computed, never read back."""
        L = self.num_local_experts
        local_expert_M = g.key_M - self.ep_rank * L
        local_M = (local_expert_M >= 0) & (local_expert_M < L)  # dropped copies: key E ≥ rank·L + L
        key_M = torch.where(local_M, local_expert_M, L)
        buffer = self.grouping(key_M, local_M, L, self.top_k, self.pad_multiple)
        x_RD, probs_R = buffer.fill(g.x_GD, g.probs_GK)
        return Dispatched(x_RD=x_RD, rows_per_expert_E=buffer.rows_per_expert_L, probs_R=probs_R,
                          handle=AllGatherHandle(buffer, g.probs_GK))

    # -------------------------------------------------------------------------------- combine

    def combine(self, y_RD: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies and over ranks is done in fp32)."""
        y_GD = self._combine_preprocess(y_RD, handle)
        return self._combine_communicate(y_GD)

    def _combine_preprocess(self, y_RD, handle: AllGatherHandle) -> torch.Tensor:
        """Back to gathered copy order, then this rank's partial sum over each token's K copies."""
        return self._reduce(handle.buffer.copies(y_RD), handle.probs_GK)

    def _combine_communicate(self, y_GD: torch.Tensor) -> torch.Tensor:
        """Sum over the group and keep this rank's T rows: the functional autograd-aware
        reduce-scatter (its backward is an all-gather). torch.distributed.nn's is deprecated in
        torch 2.13 (a FutureWarning a call) and refused under torch.compile."""
        y_TD = reduce_scatter_single_autograd(y_GD.contiguous(), "sum", scatter_dim=0, group=self.group)
        return funcol.wait_tensor(y_TD)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
"""Expert-parallel dispatchers by the name `apply_ep` takes."""


def apply_ep(layer: MoELayer, ep_group, dispatcher: str = "alltoall",
             ep_of_rank: list[int] | None = None, etp_rank: int = 0, etp_size: int = 1) -> None:
    """Keep this rank's E/ep experts (contiguous blocks by EP index) and dispatch by `dispatcher`
    ("alltoall": one host sync per call, rows sent only where needed; "allgather": no host sync,
    every rank receives all tokens; needs the same T on every rank of the group).

    With expert tensor parallelism `ep_group` is the EP×ETP group, `ep_of_rank` the EP index of
    each of its ranks, and each rank keeps hidden slice `etp_rank` of `etp_size` of its experts.
    With `moe.pad_to_capacity` ("alltoall" only) every expert gets exactly its capacity's rows
    (CapacityAllToAllDispatcher: no host sync). Call on a layer built for all E experts, on every
    rank of the group (same config); the router, shared experts and load statistics stay
    replicated and see all E experts. Expert weights stay plain local tensors
    (`distribute_experts` makes them DTensors for checkpoints and FSDP).
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"apply_ep: dispatcher={dispatcher!r}, expected one of {sorted(DISPATCHERS)}")
    if not isinstance(layer.dispatcher, LocalDispatcher):
        raise ValueError(f"apply_ep: the layer's dispatcher is {type(layer.dispatcher).__name__}, "
                         "expected LocalDispatcher (expert parallelism already applied?)")
    if not 0 <= etp_rank < etp_size:
        raise ValueError(f"apply_ep: etp_rank={etp_rank} must be in 0..{etp_size - 1} (etp_size={etp_size})")
    new_dispatcher = _ep_dispatcher(layer, dispatcher, ep_group, ep_of_rank, etp_size)
    _keep_local_experts(layer.experts, new_dispatcher.ep_rank, new_dispatcher.num_local_experts,
                        etp_rank, etp_size)
    layer.dispatcher = new_dispatcher


def _check_grid(group_size: int, ep_of_rank: list[int] | None, etp_size: int) -> None:
    """The group must be the EP×ETP grid the arguments describe: otherwise each rank would keep a
    hidden slice of experts no other rank completes, and outputs would be silently wrong."""
    grid = sorted(list(range(group_size // etp_size)) * etp_size)
    if sorted(ep_of_rank or range(group_size)) != grid or group_size % etp_size:
        raise ValueError(f"apply_ep: with etp_size={etp_size}, ep_of_rank={ep_of_rank} must give each of the "
                         f"group's {group_size} ranks an EP index, each index to {etp_size} of them")


def _ep_dispatcher(layer: MoELayer, name: str, ep_group, ep_of_rank: list[int] | None, etp_size: int):
    """`name`'s dispatcher for the layer's row layout: with `moe.pad_to_capacity`, the all-to-all
    that sends every expert exactly its capacity. Capacity drops (`moe.capacity_factor`) happen
    before dispatch, on each rank's own tokens, so every dispatcher takes them."""
    layout = layer.dispatcher.layout
    if layout.capacity_of is not None:
        refuse_padded_capacity_without_alltoall(name)
    _check_grid(dist.get_world_size(ep_group), ep_of_rank, etp_size)
    applies_probs = layer.experts.activation.applies_probs
    if layout.capacity_of is None:
        return DISPATCHERS[name](layer.top_k, layer.num_experts, ep_group, applies_probs,
                                 ep_of_rank=ep_of_rank, pad_multiple=layout.multiple)
    return CapacityAllToAllDispatcher(layer.top_k, layer.num_experts, ep_group, applies_probs,
                                      layout, ep_of_rank=ep_of_rank)


def _keep_local_experts(experts, ep_rank: int, num_local: int, etp_rank: int, etp_size: int) -> None:
    hidden = experts.w1_EDF.shape[-1]
    if hidden % etp_size:
        raise ConfigError(f"parallel.etp={etp_size} does not divide moe.expert_hidden={hidden}")
    e, f = slice(ep_rank * num_local, (ep_rank + 1) * num_local), hidden // etp_size
    f_slice = slice(etp_rank * f, (etp_rank + 1) * f)
    for name, index in (("w1_EDF", (e, slice(None), f_slice)), ("w3_EDF", (e, slice(None), f_slice)),
                        ("w2_EFD", (e, f_slice))):
        w = getattr(experts, name, None)
        if w is not None:  # w3 only with a gated activation
            setattr(experts, name, nn.Parameter(w.detach()[index].clone(), requires_grad=w.requires_grad))
    experts.num_experts = num_local


EXPERT_WEIGHT_SHARD_DIMS = {"w1_EDF": (0, 2), "w3_EDF": (0, 2), "w2_EFD": (0, 1)}
"""Per expert weight: the dim split over EP (experts) and the dim split over ETP (hidden)."""


def apply_expert_parallel(layer: MoELayer, layout, dispatcher: str) -> None:
    """EP (and ETP) of one MoE layer over `layout`'s expert grid; expert weights become DTensors on
    the (ep, etp) mesh so that checkpoints know each slice's place in the full [E, ...] tensor."""
    dims = layout.dims
    if dims.ep * dims.etp == 1:
        return
    group = layout.ep_etp_group
    ep_of_rank = [expert_coords(dims, r)[2] for r in dist.get_process_group_ranks(group)]
    etp_rank = layout.expert_coords[3]
    apply_ep(layer, group, dispatcher, ep_of_rank, etp_rank, dims.etp)
    distribute_experts(layer.experts, layout)


def distribute_experts(experts, layout) -> None:
    """Wrap the local expert weights as DTensors sharded over the mesh dims of size > 1 among
    (ep, etp): dim 0 over EP, the hidden dim over ETP."""
    dims = layout.dims
    names = [n for n, size in (("ep", dims.ep), ("etp", dims.etp)) if size > 1]
    mesh = layout.expert_mesh[tuple(names)] if len(names) > 1 else layout.expert_mesh[names[0]]
    for name, (ep_dim, etp_dim) in EXPERT_WEIGHT_SHARD_DIMS.items():
        w = getattr(experts, name, None)
        if w is None:
            continue
        placements = [Shard(ep_dim if n == "ep" else etp_dim) for n in names]
        setattr(experts, name, nn.Parameter(DTensor.from_local(w.detach(), mesh, placements,
                                                               run_check=False),
                                            requires_grad=w.requires_grad))
