"""Expert capacity: which routed copies are kept.

T tokens, K top-k, N = T·K copies, E experts.
Dropless keeps every copy; with a capacity factor each expert keeps at most
C = ceil(capacity_factor · T·K / E) copies (GShard's capacity; T counts real tokens, not padding),
chosen by probability or by position as Megatron-Core's drop policies choose: an expert's C most
probable or C earliest tokens. (GShard's top-2 ranks every token's first choice before any second
choice; position here is token order.) Padding tokens are never sent to an expert.
"""

from collections.abc import Callable
from fractions import Fraction

import torch

from moefold.config import MoEConfig
from moefold.moe.router import count_tokens_per_expert


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C copies an expert keeps; never more than T, the most it can be sent (a token's top-k are
    distinct experts), so a large factor keeps every copy without sizing padded groups past T."""
    return min(num_tokens, _capacity_ceiling(num_tokens, top_k, num_experts, capacity_factor))


def _capacity_ceiling(num_tokens, top_k: int, num_experts: int, capacity_factor: float):
    """ceil(factor · T·K / E) of an int or an integer tensor (T). Exact integer arithmetic on the
    factor as written (1.1 is 11/10): in floating point 1.1 · 100·2 / 4 = 55.00000000000001, whose
    ceiling kept 56 copies where the factor asks 55."""
    factor = Fraction(str(float(capacity_factor)))  # the shortest decimal that reads back as it
    copies = factor.numerator * num_tokens * top_k
    return -(-copies // (factor.denominator * num_experts))  # floor division: the ceiling


class Dropless:
    capacity_factor = 0.0

    def __call__(self, idx_TK: torch.Tensor, probs_TK: torch.Tensor,
                 valid_N: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(idx_TK.numel(), dtype=torch.bool, device=idx_TK.device)


class CapacityDrop:
    """Keep each expert's first C copies in a priority order: highest probability first, or earliest
    position (token order, then k) first. Copies of padding tokens (`valid_N` False) come after
    every real one, so they never take a real copy's place, and C is the real tokens' (a device
    tensor: no host sync): rows padded for a static shape (a data rank's short validation share,
    a batch split over TP ranks without sequence parallelism) would raise it, and that layout
    would keep copies one process drops. `pad_to_capacity` still sizes its rows by all T tokens,
    an upper bound."""

    def __init__(self, num_experts: int, capacity_factor: float, by_probs: bool):
        self.num_experts, self.capacity_factor, self.by_probs = num_experts, capacity_factor, by_probs

    def capacity(self, num_tokens: int, top_k: int) -> int:
        return expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)

    def __call__(self, idx_TK: torch.Tensor, probs_TK: torch.Tensor,
                 valid_N: torch.Tensor | None = None) -> torch.Tensor:
        T, K = idx_TK.shape
        idx_N = idx_TK.reshape(-1)
        priority_N = self._priority_order(probs_TK.reshape(-1).detach())
        if valid_N is not None:  # real copies first, each side in its own priority order
            priority_N = priority_N[torch.argsort(~valid_N[priority_N], stable=True)]
        by_expert_N = priority_N[torch.argsort(idx_N[priority_N], stable=True)]
        counts_E = count_tokens_per_expert(idx_TK, self.num_experts)
        start_E = counts_E.cumsum(0) - counts_E
        rank_sorted_N = torch.arange(idx_N.numel(), device=idx_N.device) - start_E[idx_N[by_expert_N]]
        keep_N = torch.empty(idx_N.numel(), dtype=torch.bool, device=idx_N.device)
        keep_N[by_expert_N] = rank_sorted_N < (self.capacity(T, K) if valid_N is None
                                               else self._capacity_of_real(valid_N, K))
        return keep_N

    def _capacity_of_real(self, valid_N: torch.Tensor, top_k: int) -> torch.Tensor:
        """`capacity` of the real tokens, counted on the device (a token's copies share its validity)."""
        tokens = valid_N.sum() // top_k
        return torch.minimum(tokens, _capacity_ceiling(tokens, top_k, self.num_experts, self.capacity_factor))

    def _priority_order(self, probs_N: torch.Tensor) -> torch.Tensor:
        if self.by_probs:
            return torch.argsort(-probs_N, stable=True)
        return torch.arange(probs_N.numel(), device=probs_N.device)


def build_capacity(num_experts: int, capacity_factor: float, drop_policy: str):
    if capacity_factor <= 0:
        return Dropless()
    return CapacityDrop(num_experts, capacity_factor, by_probs=drop_policy == "probs")


def padded_capacity(moe: MoEConfig) -> Callable[[int], int] | None:
    """`RowLayout.capacity_of` of an MoE layer: with `moe.pad_to_capacity` (and a capacity factor)
    the C rows every expert is padded to for T tokens; None when rows are not padded to capacity.
    The layer and the memory planner both lay out rows by it."""
    if not (moe.pad_to_capacity and moe.capacity_factor > 0):
        return None
    return lambda num_tokens: expert_capacity(num_tokens, moe.top_k, moe.num_experts, moe.capacity_factor)
