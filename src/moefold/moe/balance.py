"""Router auxiliary losses (load balancing, z-loss) and the module that applies those a config enables.

T tokens, E experts, K top-k, B sequences of S tokens (T = B·S).

The balancing losses are all E · Σ_e f_e · P_e (Switch Transformer's, top-1, taken to top-K as
Megatron-Core takes it): f_e the fraction of the T·K routed copies that went to expert e, every
copy counted (GShard's f counts first choices only), P_e the mean score of e. They equal 1.0 for perfectly even
routing with uniform scores and differ only in the set of tokens f and P are taken over. Every
function returns an unweighted fp32 scalar. `valid_T` (bool, True = real token) excludes padding from
every count, mean and token total. Nothing syncs with the host.

Under sequence parallelism (parallel/sequence.py) a rank holds 1/tp of each of its data rank's
sequences. Counts are then summed over the TP group (`SequenceShards`) and every mean divides a
rank's own sum by the data rank's token total: each rank's loss is its share, the shares add up to
the data rank's loss, and so do their gradients once the router's are summed over the group.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """Switch Transformer's load-balancing loss over the whole micro-batch, f over all T·K copies
    (Megatron-Core's; not GShard's, whose f counts first choices only)."""
    return sequence_aux_loss(scores_TE, idx_TK, 1, valid_T)  # the micro-batch as one sequence


def sequence_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor, batch_size: int,
                      valid_T: torch.Tensor | None = None,
                      sequence_counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """DeepSeek-V2/V3 sequence-wise loss: the balancing loss of each sequence, averaged over the
    sequences that hold at least one valid token. `sequence_counts` (routed copies per expert
    [B, E] and valid tokens [B] of the whole sequences, `sequence_counts` below): given when these
    tokens are a shard of each sequence; None counts them here."""
    T, E = scores_TE.shape
    K, S = idx_TK.shape[1], _sequence_length(T, batch_size)
    if batch_size * S != T:
        raise ValueError(f"sequence aux loss: {T} tokens do not split into batch_size={batch_size} sequences")
    if sequence_counts is None:
        sequence_counts = per_sequence_counts(idx_TK, batch_size, E, valid_T)
    counts_BE, tokens_B = sequence_counts
    fraction_BE = counts_BE / (tokens_B[:, None] * K).clamp(min=1)
    valid_BS = _valid_mask(valid_T, T, scores_TE.device).view(batch_size, S)
    mean_scores_BE = _masked_sum(scores_TE.view(batch_size, S, E), valid_BS) / tokens_B[:, None].clamp(min=1)
    loss_B = _balance_loss(fraction_BE, mean_scores_BE)
    return loss_B.sum() / (tokens_B > 0).sum().clamp(min=1)


def per_sequence_counts(idx_TK: torch.Tensor, batch_size: int, num_experts: int,
                        valid_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ([B, E] routed copies per expert, [B] valid tokens) of each of the B sequences."""
    T, K = idx_TK.shape
    S = _sequence_length(T, batch_size)
    valid_BS = _valid_mask(valid_T, T, idx_TK.device).view(batch_size, S)
    counts_BE = _counts_per_sequence(idx_TK.reshape(batch_size, S * K), valid_BS.repeat_interleave(K, dim=1),
                                     num_experts)
    return counts_BE, valid_BS.sum(dim=1)


def global_batch_aux_loss(scores_TE: torch.Tensor, idx_TK: torch.Tensor,
                          accumulated_counts_E: torch.Tensor, accumulated_tokens: torch.Tensor | int,
                          valid_T: torch.Tensor | None = None,
                          mean_over: torch.Tensor | None = None) -> torch.Tensor:
    """Global-batch loss: f_e from the routed copies and valid tokens accumulated over the optimizer
    step's micro-batches so far (this one included), P_e from this micro-batch. A wider f evens out
    the load of the step rather than forcing every micro-batch to be even (Qwen, "Demons in the
    Detail", 2025). `mean_over`: the token total P_e divides by (the data rank's, when these tokens
    are a sequence shard of it); None: these valid tokens."""
    T, E = scores_TE.shape
    K = idx_TK.shape[1]
    fraction_E = accumulated_counts_E / (torch.as_tensor(accumulated_tokens) * K).clamp(min=1)
    valid_1T = _valid_mask(valid_T, T, scores_TE.device).view(1, T)
    if mean_over is None:
        mean_over = valid_1T.sum()
    mean_scores_E = _masked_sum(scores_TE.view(1, T, E), valid_1T)[0] / mean_over.clamp(min=1)
    return _balance_loss(fraction_E.to(mean_scores_E), mean_scores_E)


def z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None,
           mean_over: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)², keeping the logits small.
    `mean_over`: the token total to divide by, as in `global_batch_aux_loss`."""
    valid_T = _valid_mask(valid_T, logits_TE.shape[0], logits_TE.device)
    # Mask before logsumexp, so that a padded token's (possibly huge) logits cannot reach the loss
    # or its gradient.
    logits_TE = torch.where(valid_T[:, None], logits_TE, 0.0)
    lse_sq_T = torch.where(valid_T, torch.logsumexp(logits_TE, dim=-1).square(), 0.0)
    if mean_over is None:
        mean_over = valid_T.sum()
    return (lse_sq_T.sum() / mean_over.clamp(min=1)).float()


def valid_tokens_per_expert(idx_TK: torch.Tensor, num_experts: int,
                            valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [E]: routed copies per expert, padded tokens excluded."""
    valid_1N = _valid_mask(valid_T, idx_TK.shape[0], idx_TK.device).repeat_interleave(idx_TK.shape[1])[None]
    return _counts_per_sequence(idx_TK.reshape(1, -1), valid_1N, num_experts)[0]


def _sequence_length(num_tokens: int, batch_size: int) -> int:
    """S of B sequences of T = B·S tokens; 0 for an empty batch, where `view(0, -1)` is ambiguous."""
    return num_tokens // batch_size if batch_size else 0


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


def _masked_sum(scores_BSE: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
    """[B, E]: the scores of each expert summed over the valid tokens of each sequence."""
    return torch.where(valid_BS[..., None], scores_BSE, 0.0).sum(dim=1)


def _balance_loss(fraction_BE: torch.Tensor, mean_scores_BE: torch.Tensor) -> torch.Tensor:
    return mean_scores_BE.shape[-1] * (fraction_BE * mean_scores_BE).sum(dim=-1)


@dataclass
class RoutedCounts:
    """What a micro-batch routed, over the tokens the balancing losses see (padding excluded)."""
    per_expert_E: torch.Tensor  # int64: routed copies per expert
    tokens: torch.Tensor  # int64 scalar: valid tokens
    dropped: torch.Tensor  # int64 scalar: valid copies dropped by the capacity limit
    # int64 scalar: this data rank's valid tokens, the total the mean scores P_e and the z-loss
    # divide by (its sequences' shards over the TP group under sequence parallelism)
    data_rank_tokens: torch.Tensor


def whole_sequences(t: torch.Tensor) -> torch.Tensor:
    """A process holding its sequences whole: a count over them is its own."""
    return t


class SequenceShards:
    """Sequence parallelism: each rank of `group` holds a shard of the same sequences, so a count or
    sum over them adds up every shard's (one all-reduce, never differentiated)."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    @torch.no_grad()
    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t


class LocalCounts:
    """Counts of this data rank's micro-batch: this process's tokens, or with
    `sum_over_shards=SequenceShards(tp_group)` its sequences' shards on every TP rank."""

    def __init__(self, sum_over_shards: Callable[[torch.Tensor], torch.Tensor] = whole_sequences):
        self.sum_over_shards = sum_over_shards

    @torch.no_grad()
    def __call__(self, idx_TK: torch.Tensor, keep_N: torch.Tensor, num_experts: int,
                 valid_T: torch.Tensor | None) -> RoutedCounts:
        T, K = idx_TK.shape
        valid_T = _valid_mask(valid_T, T, idx_TK.device)
        per_expert_E = valid_tokens_per_expert(idx_TK, num_experts, valid_T)
        # Real copies left out: keep_N may keep padding (the balancer's own all-True mask does).
        dropped = (valid_T.repeat_interleave(K) & ~keep_N).sum()
        counts = self.sum_over_shards(_packed(per_expert_E, valid_T.sum(), dropped))
        return _unpacked(counts, num_experts, data_rank_tokens=counts[num_experts])


class DataParallelCounts(LocalCounts):
    """Counts summed over the data-parallel ranks (one int64 all-reduce of E + 2 values), so that
    f_e in every balancing loss, the expert-bias update and the load statistics cover the global
    micro-batch: a layout then trains exactly like one process. (The scores' mean P_e stays the
    data rank's; averaging the gradients over the ranks makes it global.)"""

    def __init__(self, group: ProcessGroup,
                 sum_over_shards: Callable[[torch.Tensor], torch.Tensor] = whole_sequences):
        super().__init__(sum_over_shards)
        self.group = group

    @torch.no_grad()
    def __call__(self, idx_TK, keep_N, num_experts, valid_T) -> RoutedCounts:
        data_rank = super().__call__(idx_TK, keep_N, num_experts, valid_T)
        packed = _packed(data_rank.per_expert_E, data_rank.tokens, data_rank.dropped)
        dist.all_reduce(packed, group=self.group)
        return _unpacked(packed, num_experts, data_rank.data_rank_tokens)


def _packed(per_expert_E: torch.Tensor, tokens: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    return torch.cat([per_expert_E, tokens[None], dropped[None]])


def _unpacked(packed: torch.Tensor, num_experts: int, data_rank_tokens: torch.Tensor) -> RoutedCounts:
    return RoutedCounts(packed[:num_experts], packed[num_experts], packed[num_experts + 1], data_rank_tokens)


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
        self.sum_over_shards = whole_sequences  # SequenceShards under sequence parallelism

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
                                     counts.tokens, valid_T, counts.data_rank_tokens)

    def _sequence(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        return sequence_aux_loss(routing.scores_TE, routing.idx_TK, batch_size, valid_T,
                                 self._sequence_counts(routing.idx_TK, batch_size, valid_T))

    def _global_batch(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        counts_E, tokens = self._accumulate(counts)
        return global_batch_aux_loss(routing.scores_TE, routing.idx_TK, counts_E, tokens, valid_T,
                                     counts.data_rank_tokens)

    def _z(self, routing: Routing, batch_size: int, valid_T, counts: RoutedCounts):
        return z_loss(routing.logits_TE, valid_T, counts.data_rank_tokens)

    @torch.no_grad()
    def _sequence_counts(self, idx_TK: torch.Tensor, batch_size: int,
                         valid_T: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence counts of the whole sequences: one [B, E + 1] sum over the shards."""
        counts_BE, tokens_B = per_sequence_counts(idx_TK, batch_size, self.num_experts, valid_T)
        both = self.sum_over_shards(torch.cat([counts_BE, tokens_B[:, None]], dim=1))
        return both[:, :-1], both[:, -1]

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
