"""Dispatchers move routed token copies to their experts and back.

T tokens, K top-k, N = T·K routed copies, D model dim, E experts.
`dispatch` returns the rows grouped by local expert plus a small handle; `combine` takes the expert
outputs and the handle back to token order. Expert-parallel dispatchers (all-to-all, all-gather)
arrive with the parallel-folding work and keep this interface.
"""

from dataclasses import dataclass

import torch

from moefold.moe.permute import permute, sort_by_expert, unpermute
from moefold.moe.router import Routing


@dataclass
class DispatchHandle:
    order_N: torch.Tensor  # routed copies sorted by expert
    probs_TK: torch.Tensor  # combine weights


class LocalDispatcher:
    """All experts live on this rank: dispatch is a permutation, combine its weighted inverse."""

    def __init__(self, top_k: int):
        self.top_k = top_k

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        order_N = sort_by_expert(routing.idx_TK)
        x_ND = permute(x_TD, order_N, self.top_k)
        return x_ND, routing.tokens_per_expert_E, DispatchHandle(order_N, routing.probs_TK)

    def combine(self, y_ND: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return unpermute(y_ND, handle.order_N, handle.probs_TK)
