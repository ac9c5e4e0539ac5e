"""Dispatchers move routed token copies to their experts and back.

T tokens, K top-k, N = T·K routed copies, D model dim, E experts, R expert-buffer rows.
`dispatch` returns the rows grouped by local expert (with group sizes and each row's routing
probability) plus a small handle; `combine` takes the expert outputs and the handle back to token
order. The expert-parallel dispatchers (all-to-all, all-gather, pad-to-capacity all-to-all:
parallel/expert.py) and the TP split (parallel/sequence.py) keep this interface.
"""

from dataclasses import dataclass

import torch

from moefold.moe.permute import PermutePlan, RowLayout, permute, plan_permutation, row_probs, unpermute
from moefold.moe.router import Routing


@dataclass
class DispatchHandle:
    plan: PermutePlan
    probs_TK: torch.Tensor  # combine weights


@dataclass
class Dispatched:
    x_RD: torch.Tensor
    rows_per_expert_E: torch.Tensor
    probs_R: torch.Tensor  # each row's routing probability (0 for padding rows)
    handle: DispatchHandle


class LocalDispatcher:
    """All experts live on this rank: dispatch is a permutation, combine its inverse.

    `probs_applied_by_experts` (memory-efficient permutation) makes combine a plain sum over the K
    copies; otherwise combine weights them by their probabilities.
    """

    def __init__(self, top_k: int, layout: RowLayout, probs_applied_by_experts: bool):
        self.top_k, self.layout = top_k, layout
        self._reduce = _sum_copies if probs_applied_by_experts else _weighted_sum_copies

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, keep_N: torch.Tensor) -> Dispatched:
        plan = plan_permutation(routing.idx_TK, keep_N, self.layout)
        return Dispatched(x_RD=permute(x_TD, plan, self.top_k),
                          rows_per_expert_E=plan.rows_per_expert_E,
                          probs_R=row_probs(routing.probs_TK, plan),
                          handle=DispatchHandle(plan, routing.probs_TK))

    def combine(self, y_RD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y_TD in fp32 (the sum over K copies is done in fp32)."""
        return self._reduce(unpermute(y_RD, handle.plan, self.top_k), handle.probs_TK)


def _sum_copies(y_TKD: torch.Tensor, probs_TK: torch.Tensor) -> torch.Tensor:
    return y_TKD.sum(dim=1, dtype=torch.float32)  # accumulates in fp32 without an fp32 copy


def _weighted_sum_copies(y_TKD: torch.Tensor, probs_TK: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tkd,tk->td", y_TKD.float(), probs_TK.float())
