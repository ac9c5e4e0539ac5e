"""Router auxiliary losses (load balancing, z-loss) and the module that applies those a config enables.

T tokens, E experts, K top-k, B sequences of S tokens (T = B·S).

The balancing losses are all E · Σ_e f_e · P_e (Switch Transformer, GShard): f_e the fraction of the
routed copies that went to expert e, P_e the mean score of e. They equal 1.0 for perfectly even
routing with uniform scores and differ only in the set of tokens f and P are taken over. Every
function returns an unweighted fp32 scalar. `valid_T` (bool, True = real token) excludes padding from
every count, mean and token total. Nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moefold.config import MoEConfig
from moefold.moe.recomputing import in_backward
from moefold.moe.router import count_tokens_per_expert

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from moefold.moe.router import Routing


def micro_batch_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor,
                         valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/GShard load-balancing loss over the whole micro-batch."""
    return sequence_aux_loss(scores_TE, idx_TK, 1, valid_T)  # the micro-batch as one sequence


def sequence_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor, batch_size: int,
                      valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V2/V3 sequence-wise loss: the balancing loss of each sequence, averaged over the
    sequences that hold at least one valid token."""
    T, E = scores_TE.shape
    K = idx_TK.shape[1]
    if T % batch_size:
        raise ValueError(f"sequence aux loss: {T} tokens do not split into batch_size={batch_size} sequences")
    valid_BS = _valid_mask(valid_T, T, scores_TE.device).view(batch_size, -1)
    idx_BN = idx_TK.reshape(batch_size, -1)
    counts_BE = _counts_per_sequence(idx_BN, valid_BS.repeat_interleave(K, dim=1), E)
    tokens_B = valid_BS.sum(dim=1)
    fraction_BE = counts_BE / (tokens_B[:, None] * K).clamp(min=1)
    mean_scores_BE = _masked_mean(scores_TE.view(batch_size, -1, E), valid_BS)
    loss_B = _balance_loss(fraction_BE, mean_scores_BE)
    return loss_B.sum() / (tokens_B > 0).sum().clamp(min=1)


def global_batch_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor,
                          accumulated_counts_E: torch.Tensor, accumulated_tokens: torch.Tensor | int,
                          valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """Global-batch loss: f_e from the routed copies and valid tokens accumulated over the optimizer
    step's micro-batches so far (this one included), P_e from this micro-batch. A wider f evens out
    the load of the step rather than forcing every micro-batch to be even (Qwen, "Demons in the
    Detail", 2025)."""
    T, E = scores_TE.shape
    K = idx_TK.shape[1]
    fraction_E = accumulated_counts_E / (torch.as_tensor(accumulated_tokens) * K).clamp(min=1)
    valid_1T = _valid_mask(valid_T, T, scores_TE.device).view(1, T)
    mean_scores_E = _masked_mean(scores_TE.view(1, T, E), valid_1T)[0]
    return _balance_loss(fraction_E.to(mean_scores_E), mean_scores_E)


def z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)², keeping the logits small."""
    valid_T = _valid_mask(valid_T, logits_TE.shape[0], logits_TE.device)
    # Mask before logsumexp, so that a padded token's (possibly huge) logits cannot reach the loss
    # or its gradient.
    logits_TE = torch.where(valid_T[:, None], logits_TE, 0.0)
    lse_sq_T = torch.where(valid_T, torch.logsumexp(logits_TE, dim=-1).square(), 0.0)
    return (lse_sq_T.sum() / valid_T.sum().clamp(min=1)).float()


def valid_tokens_per_expert(idx_TK: torch.Tensor, num_experts: int,
                            valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [E]: routed copies per expert, padded tokens excluded."""
    valid_1N = _valid_mask(valid_T, idx_TK.shape[0], idx_TK.device).repeat_interleave(idx_TK.shape[1])[None]
    return _counts_per_sequence(idx_TK.reshape(1, -1), valid_1N, num_experts)[0]


def _valid_mask(valid_T: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    if valid_T is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    return valid_T.reshape(num_tokens)  # also takes a [B, S] mask


def _counts_per_sequence(idx_BN: torch.Tensor, valid_BN: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [B, E]: copies per expert in each sequence. Invalid copies go to a spare bin E that is
    dropped, and each sequence gets its own E+1 bins, so one flat scatter_add counts them all."""
    B = idx_BN.shape[0]
    bins = num_experts + 1
    bin_BN = idx_BN.masked_fill(~valid_BN, num_experts) + bins * torch.arange(B, device=idx_BN.device)[:, None]
    return count_tokens_per_expert(bin_BN, B * bins).view(B, bins)[:, :num_experts]


def _masked_mean(scores_BSE: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
    """[B, E]: mean score of each expert over the valid tokens of each sequence (0 for none)."""
    total_BE = torch.where(valid_BS[..., None], scores_BSE, 0.0).sum(dim=1)
    return total_BE / valid_BS.sum(dim=1, keepdim=True).clamp(min=1)


def _balance_loss(fraction_BE: torch.Tensor, mean_scores_BE: torch.Tensor) -> torch.Tensor:
    return mean_scores_BE.shape[-1] * (fraction_BE * mean_scores_BE).sum(dim=-1)


@dataclass
class RoutedCounts:
    """What a micro-batch routed, over the tokens the balancing losses see (padding excluded)."""
    per_expert_E: torch.Tensor  # int64: routed copies per expert
    tokens: torch.Tensor  # int64 scalar: valid tokens
    dropped: torch.Tensor  # int64 scalar: valid copies dropped by the capacity limit


class LocalCounts:
    """Counts of this process's micro-batch: the whole micro-batch in one process."""

    @torch.no_grad()
    def __call__(self, idx_TK: torch.Tensor, keep_N: torch.Tensor, num_experts: int,
                 valid_T: torch.Tensor | None) -> RoutedCounts:
        per_expert_E = valid_tokens_per_expert(idx_TK, num_experts, valid_T)
        tokens = _valid_mask(valid_T, idx_TK.shape[0], idx_TK.device).sum()
        # keep_N already excludes padding, so kept copies are all valid
        return RoutedCounts(per_expert_E, tokens, per_expert_E.sum() - keep_N.sum())


class DataParallelCounts(LocalCounts):
    """Counts summed over the data-parallel ranks (one int64 all-reduce of E + 2 values), so that
    f_e in every balancing loss, the expert-bias update and the load statistics cover the global
    micro-batch: a layout then trains exactly like one process. (The scores' mean P_e stays local;
    averaging the gradients over the ranks makes it global.)"""

    def __init__(self, group: ProcessGroup):
        self.group = group

    @torch.no_grad()
    def __call__(self, idx_TK, keep_N, num_experts, valid_T) -> RoutedCounts:
        local = super().__call__(idx_TK, keep_N, num_experts, valid_T)
        packed = torch.cat([local.per_expert_E, local.tokens[None], local.dropped[None]])
        dist.all_reduce(packed, group=self.group)
        return RoutedCounts(packed[:num_experts], packed[num_experts], packed[num_experts + 1])


class LoadBalancer(nn.Module):
    """The aux losses enabled in cfg, each with its coefficient.

    forward → (Σ coeff · loss, {name: unweighted loss, detached}) over the enabled losses of
    aux_loss (micro-batch), seq_aux_loss, global_aux_loss and z_loss. The global loss's counts
    accumulate (training mode only, so evaluation does not shift them) until the trainer calls
    `reset_global_counts` after each optimizer step.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.register_buffer("global_counts_E", torch.zeros(cfg.num_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("global_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        terms = [("aux_loss", cfg.aux_loss_coeff, self._micro_batch),
                 ("seq_aux_loss", cfg.seq_aux_loss_coeff, self._sequence),
                 ("global_aux_loss", cfg.global_aux_loss_coeff, self._global_batch),
                 ("z_loss", cfg.z_loss_coeff, self._z)]
        self.terms = [(name, coeff, loss_fn) for name, coeff, loss_fn in terms if coeff > 0]

    def forward(self, routing: Routing, batch_size: int, valid_T: torch.Tensor | None,
                counts: RoutedCounts | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`counts`: the micro-batch's routed counts (the MoE layer passes them summed over the
        data-parallel ranks); None counts this micro-batch alone."""
        if counts is None:
            keep_N = torch.ones(routing.idx_TK.numel(), dtype=torch.bool, device=routing.idx_TK.device)
            counts = LocalCounts()(routing.idx_TK, keep_N, self.num_experts, valid_T)
        total = torch.zeros((), dtype=torch.float32, device=routing.scores_TE.device)
        values = {}
        for name, coeff, loss_fn in self.terms:
            loss = loss_fn(routing, batch_size, valid_T, counts)
            total = total + coeff * loss
            values[name] = loss.detach()
        return total, values

    @torch.no_grad()
    def reset_global_counts(self) -> None:
        self.global_counts_E.zero_()
        self.global_tokens.zero_()

    def _micro_batch(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        # The micro-batch loss is the global-batch formula with this micro-batch's counts (which
        # are the global micro-batch's under data parallelism, see DataParallelCounts).
        return global_batch_aux_loss(routing.scores_TE, routing.idx_TK, counts.per_expert_E,
                                     counts.tokens, valid_T)

    def _sequence(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        return sequence_aux_loss(routing.scores_TE, routing.idx_TK, batch_size, valid_T)

    def _global_batch(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        counts_E, tokens = self._accumulate(counts)
        return global_batch_aux_loss(routing.scores_TE, routing.idx_TK, counts_E, tokens, valid_T)

    def _z(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        return z_loss(routing.logits_TE, valid_T)

    @torch.no_grad()
    def _accumulate(self, counts: RoutedCounts) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's counts including this micro-batch; stored only in training mode. A
        recompute of torch's own (moefold's replays the forward's result instead) takes the stored
        counts, which hold this micro-batch already: what its forward took, when no other forward
        of the layer ran between that forward and this backward."""
        if in_backward():
            return self.global_counts_E.clone(), self.global_tokens.clone()
        counts_E = self.global_counts_E + counts.per_expert_E
        tokens = self.global_tokens + counts.tokens
        if self.training:
            self.global_counts_E.copy_(counts_E)
            self.global_tokens.copy_(tokens)
        return counts_E, tokens
