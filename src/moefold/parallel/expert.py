"""Expert parallelism: each rank of the EP group holds E/ep experts; routed copies travel to them
by all-to-all and back.

T tokens, K top-k, N = T·K routed copies, D model dim, E experts (global), L = E/ep local experts,
P ep ranks, S rows this rank sends (its kept copies), R rows it receives.

`AllToAllDispatcher` keeps the `LocalDispatcher` interface, so `MoELayer` does not change; its
phases (preprocess → communicate → postprocess, and the reverse for combine) are small methods
whose state passes in the handle, so a scheduler can later overlap communication with compute.
`AllGatherDispatcher` is the host-sync-free alternative: every rank gathers all ranks' tokens and
routing, computes the copies routed to its experts and reduce-scatters the outputs back (more
traffic, P·T·D each way, but static shapes and no device→host copy). `apply_ep` turns a built,
single-process `MoELayer` into the EP one in place, with either dispatcher.

For the all-gather dispatcher: G = P·T gathered tokens, M = G·K gathered copies; its expert buffer
has M rows (static), this rank's copies first, grouped by local expert.

Rows go out sorted by global expert, hence grouped by destination rank (experts are contiguous
blocks by rank: rank p holds experts p·L .. p·L+L-1); they arrive grouped by source rank, then by
local expert, and are regrouped by local expert for the grouped GEMM.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from moefold.errors import ConfigError
from moefold.moe.capacity import Dropless
from moefold.moe.dispatch import (
    Dispatched,
    LocalDispatcher,
    _sum_copies,
    _weighted_sum_copies,
)
from moefold.moe.layer import MoELayer
from moefold.moe.router import Routing


@dataclass
class AllToAllHandle:
    order_N: torch.Tensor  # int64: copies sorted by global expert (kept first, dropped last)
    keep_N: torch.Tensor  # bool: the copy was sent
    regroup_R: torch.Tensor  # int64: received row (source-major) at each expert-grouped row
    send_splits: list[int]  # rows sent to each ep rank (host)
    recv_splits: list[int]  # rows received from each ep rank (host)
    probs_TK: torch.Tensor  # combine weights, used when the experts did not apply them


@dataclass
class _Sorted:
    """preprocess → communicate: this rank's kept copies sorted by global expert."""
    x_SD: torch.Tensor
    probs_S: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    order_N: torch.Tensor


class _ExpertParallelDispatcher:
    """What both EP dispatchers share: the group, this rank's block of E/ep experts, and how
    combine sums a token's K copies (plain when the experts applied the probabilities)."""

    def __init__(self, top_k: int, num_experts: int, ep_group, probs_applied_by_experts: bool):
        self.top_k, self.num_experts, self.ep_group = top_k, num_experts, ep_group
        self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ConfigError(f"parallel.ep={self.ep_size} does not divide "
                              f"moe.num_experts={num_experts}")
        self.num_local_experts = num_experts // self.ep_size
        self._reduce = _sum_copies if probs_applied_by_experts else _weighted_sum_copies


class AllToAllDispatcher(_ExpertParallelDispatcher):
    """Dropless all-to-all dispatch over `ep_group` (Megatron-Core's MoEAlltoAllTokenDispatcher).

    One device→host copy per layer call: the split sizes the all-to-all needs on the host. Tokens and
    their routing probabilities travel through the autograd-aware all-to-all, so backward runs the
    reverse exchanges and the router gets its gradient through the experts (memory-efficient path)
    or through combine (otherwise).
    """

    # ------------------------------------------------------------------------------- dispatch

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        sorted_ = self._preprocess(x_TD, routing, keep_N)
        x_RD, probs_R, counts_PL, send_splits, recv_splits = self._communicate(sorted_)
        x_RD, probs_R, rows_per_expert_L, regroup_R = self._postprocess(x_RD, probs_R, counts_PL)
        handle = AllToAllHandle(sorted_.order_N, keep_N, regroup_R, send_splits, recv_splits,
                                routing.probs_TK)
        return Dispatched(x_RD=x_RD, rows_per_expert_E=rows_per_expert_L, probs_R=probs_R, handle=handle)

    def _preprocess(self, x_TD, routing: Routing, keep_N) -> _Sorted:
        """Sort the copies by global expert (stable: token order within an expert); dropped copies
        (padding tokens) get key E and sort last, past the S rows that are sent."""
        E = self.num_experts
        key_N = torch.where(keep_N, routing.idx_TK.reshape(-1), E)
        order_N = torch.argsort(key_N, stable=True)
        counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=key_N.device)
        counts_E1.scatter_add_(0, key_N, torch.ones_like(key_N))
        return _Sorted(x_SD=x_TD.index_select(0, order_N // self.top_k),
                       probs_S=routing.probs_TK.reshape(-1).index_select(0, order_N),
                       tokens_per_expert_E=counts_E1[:E], order_N=order_N)

    def _communicate(self, s: _Sorted):
        """Counts all-to-all, the one host copy of the split sizes, then tokens and probs."""
        P, L = self.ep_size, self.num_local_experts
        # counts_PL[p, l]: rows source rank p sends to this rank's local expert l.
        counts_PL = torch.empty_like(s.tokens_per_expert_E)
        dist.all_to_all_single(counts_PL, s.tokens_per_expert_E, group=self.ep_group)
        counts_PL = counts_PL.view(P, L)
        splits_2P = torch.cat([s.tokens_per_expert_E.view(P, L).sum(1), counts_PL.sum(1)])
        splits = splits_2P.tolist()  # HOST SYNC: all_to_all needs split sizes on the host
        send_splits, recv_splits = splits[:P], splits[P:]
        S, R = sum(send_splits), sum(recv_splits)
        x_RD = self._all_to_all(s.x_SD[:S], R, recv_splits, send_splits)
        probs_R = self._all_to_all(s.probs_S[:S], R, recv_splits, send_splits)
        return x_RD, probs_R, counts_PL, send_splits, recv_splits

    def _postprocess(self, x_RD, probs_R, counts_PL):
        """Regroup the received rows (source-major) by local expert, stable within a source."""
        P, L = counts_PL.shape
        R = x_RD.shape[0]
        local_expert_PL = torch.arange(L, device=counts_PL.device).repeat(P)
        # output_size given: no host sync for repeat_interleave's result size.
        expert_of_row_R = local_expert_PL.repeat_interleave(counts_PL.reshape(-1), output_size=R)
        regroup_R = torch.argsort(expert_of_row_R, stable=True)
        return (x_RD.index_select(0, regroup_R), probs_R.index_select(0, regroup_R),
                counts_PL.sum(0), regroup_R)

    # -------------------------------------------------------------------------------- combine

    def combine(self, y_RD: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies is done in fp32)."""
        y_RD = self._combine_preprocess(y_RD, handle)
        y_SD = self._all_to_all(y_RD, sum(handle.send_splits), handle.send_splits, handle.recv_splits)
        return self._combine_postprocess(y_SD, handle)

    def _combine_preprocess(self, y_RD, handle: AllToAllHandle):
        """Undo the regrouping: back to source-major order, by a gather through the inverse."""
        R = handle.regroup_R.numel()
        inverse_R = torch.empty_like(handle.regroup_R).scatter_(
            0, handle.regroup_R, torch.arange(R, device=handle.regroup_R.device))
        return y_RD[:R].index_select(0, inverse_R)

    def _combine_postprocess(self, y_SD, handle: AllToAllHandle):
        """Un-sort into copy order (a gather; zeros for dropped copies) and sum the K copies."""
        N = handle.order_N.numel()
        position_N = torch.empty_like(handle.order_N).scatter_(
            0, handle.order_N, torch.arange(N, device=handle.order_N.device))
        # Kept copies sit at positions < S; dropped ones read an appended zero row (index S), so the
        # result always depends on y_SD and backward reaches the all-to-all on every rank.
        S = y_SD.shape[0]
        y_S1D = torch.cat([y_SD, y_SD.new_zeros(1, y_SD.shape[-1])])
        y_ND = y_S1D.index_select(0, torch.where(handle.keep_N, position_N, S))
        return self._reduce(y_ND.view(-1, self.top_k, y_SD.shape[-1]), handle.probs_TK)

    def _all_to_all(self, x: torch.Tensor, out_rows: int, out_splits: list[int],
                    in_splits: list[int]) -> torch.Tensor:
        out = x.new_empty(out_rows, *x.shape[1:])
        return dist_fn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.ep_group)


@dataclass
class AllGatherHandle:
    position_M: torch.Tensor  # int64: each gathered copy's row in the expert buffer
    local_M: torch.Tensor  # bool: the gathered copy is kept and routed to one of this rank's experts
    probs_GK: torch.Tensor  # gathered combine weights, used when the experts did not apply them


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

    # ------------------------------------------------------------------------------- dispatch

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        key_N = self._preprocess(x_TD, routing, keep_N)
        gathered = self._communicate(x_TD, key_N, routing.probs_TK)
        return self._postprocess(gathered)

    def _preprocess(self, x_TD, routing: Routing, keep_N) -> torch.Tensor:
        """Check that every rank has the same T; dropped copies (padding tokens) get key E."""
        self._check_same_num_tokens(x_TD.shape[0], keep_N.device)
        return torch.where(keep_N, routing.idx_TK.reshape(-1), self.num_experts)

    def _check_same_num_tokens(self, T: int, device) -> None:
        """One 2-element all-reduce and a device-side assert (no host sync on CUDA): gathering
        unequal sizes would be undefined (NCCL reads or writes out of bounds, or hangs)."""
        bounds = torch.full((2,), T, dtype=torch.int64, device=device)
        bounds[1].neg_()
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.ep_group)  # max T, −min T
        torch._assert_async(bounds.sum() == 0,
                            f"AllGatherDispatcher needs the same number of tokens (batch·sequence) on "
                            f"every EP rank; this rank has {T} and another differs (use "
                            "dispatcher='alltoall' for uneven token counts)")

    def _communicate(self, x_TD, key_N, probs_TK) -> _Gathered:
        """Tokens and probabilities by the autograd-aware all-gather; expert ids need no gradient."""
        key_M = key_N.new_empty(self.ep_size * key_N.numel())
        dist.all_gather_into_tensor(key_M, key_N.contiguous(), group=self.ep_group)
        return _Gathered(x_GD=torch.cat(dist_fn.all_gather(x_TD, group=self.ep_group)),
                         key_M=key_M,
                         probs_GK=torch.cat(dist_fn.all_gather(probs_TK, group=self.ep_group)))

    def _postprocess(self, g: _Gathered) -> Dispatched:
        """Static-shape sort by local expert (stable: gathered order within an expert); copies for
        other ranks' experts and dropped ones get key L and sort last: rows past the last local group
        hold zeros, are never computed, and are never read back by combine."""
        L, M = self.num_local_experts, g.key_M.numel()
        local_expert_M = g.key_M - self.ep_rank * L
        local_M = (local_expert_M >= 0) & (local_expert_M < L)  # dropped copies: key E ≥ rank·L + L
        key_M = torch.where(local_M, local_expert_M, L)
        order_M = torch.argsort(key_M, stable=True)
        counts_L1 = torch.zeros(L + 1, dtype=torch.int64, device=key_M.device)
        counts_L1.scatter_add_(0, key_M, torch.ones_like(key_M))
        row_valid_R = local_M.index_select(0, order_M)  # R = M rows
        # Zeros (not other ranks' tokens) in the unused rows, so no gradient flows through them.
        x_RD = torch.where(row_valid_R[:, None], g.x_GD.index_select(0, order_M // self.top_k), 0)
        probs_R = torch.where(row_valid_R, g.probs_GK.reshape(-1).index_select(0, order_M), 0)
        position_M = torch.empty_like(order_M).scatter_(
            0, order_M, torch.arange(M, device=order_M.device))
        handle = AllGatherHandle(position_M, local_M, g.probs_GK)
        return Dispatched(x_RD=x_RD, rows_per_expert_E=counts_L1[:L], probs_R=probs_R, handle=handle)

    # -------------------------------------------------------------------------------- combine

    def combine(self, y_RD: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies and over ranks is done in fp32)."""
        y_GD = self._combine_preprocess(y_RD, handle)
        return self._combine_communicate(y_GD)

    def _combine_preprocess(self, y_RD, handle: AllGatherHandle) -> torch.Tensor:
        """Back to gathered copy order (a gather; `torch.where` keeps whatever the experts left in
        unused rows, even NaN, out), then this rank's partial sum over each token's K copies."""
        y_MD = y_RD.index_select(0, handle.position_M)
        y_MD = torch.where(handle.local_M[:, None], y_MD, 0)
        return self._reduce(y_MD.view(-1, self.top_k, y_RD.shape[-1]), handle.probs_GK)

    def _combine_communicate(self, y_GD: torch.Tensor) -> torch.Tensor:
        """Sum over the group and keep this rank's T rows: the autograd-aware reduce-scatter
        (gloo has reduce_scatter in torch ≥ 2.x; its backward is an all-gather)."""
        chunks = list(y_GD.chunk(self.ep_size))
        return dist_fn.reduce_scatter(torch.empty_like(chunks[0]), chunks, group=self.ep_group)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
"""Expert-parallel dispatchers by the name `apply_ep` takes."""


def apply_ep(layer: MoELayer, ep_group, dispatcher: str = "alltoall") -> None:
    """Keep this rank's E/ep experts (contiguous blocks by EP rank) and dispatch by `dispatcher`
    ("alltoall": one host sync per call, rows sent only where needed; "allgather": no host sync,
    every rank receives all tokens; needs the same T on every EP rank).

    Call on a layer built for all E experts, on every rank of `ep_group` (same config); the router,
    shared experts and load statistics stay replicated and see all E experts.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"apply_ep: dispatcher={dispatcher!r}, expected one of {sorted(DISPATCHERS)}")
    if not isinstance(layer.dispatcher, LocalDispatcher):
        raise ValueError(f"apply_ep: the layer's dispatcher is {type(layer.dispatcher).__name__}, "
                         "expected LocalDispatcher (expert parallelism already applied?)")
    if not isinstance(layer.capacity, Dropless):
        raise ConfigError(f"moe.capacity_factor={layer.capacity.capacity_factor} is not supported "
                          "with parallel.ep > 1 yet (only dropless, capacity_factor=0)")
    if layer.dispatcher.layout.multiple > 1:
        raise ConfigError(f"moe.pad_multiple={layer.dispatcher.layout.multiple} is not supported with "
                          "parallel.ep > 1 yet (only 0)")
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    experts = layer.experts
    if experts.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide moe.num_experts={experts.num_experts}")
    num_local = experts.num_experts // ep
    start = rank * num_local
    for name in ("w1_EDF", "w3_EDF", "w2_EFD"):
        w = getattr(experts, name, None)
        if w is not None:  # w3 only with a gated activation
            local = w.detach()[start:start + num_local].clone()
            setattr(experts, name, nn.Parameter(local, requires_grad=w.requires_grad))
    experts.num_experts = num_local
    layer.dispatcher = DISPATCHERS[dispatcher](
        layer.top_k, layer.num_experts, ep_group,
        probs_applied_by_experts=experts.activation.applies_probs)
