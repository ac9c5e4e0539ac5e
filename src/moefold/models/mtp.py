"""Multi-token prediction (DeepSeek-V3): module k predicts token t+k+1 from the previous depth's
hidden state at t and the embedding of token t+k, sharing the embedding and output head.

B batch, S sequence, D model dim, V vocabulary.
"""

import torch
from torch import nn

from moefold.data.loader import IGNORE_INDEX
from moefold.models.norm import RMSNorm
from moefold.moe.layer import valid_mask


class MTPModule(nn.Module):
    def __init__(self, block: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.enorm, self.hnorm = RMSNorm(dim, norm_eps), RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)  # the module's own final norm before the shared head

    def forward(self, h_BSD, emb_BSD, cos, sin, valid_BS=None) -> torch.Tensor:
        """The next depth's hidden state (before `norm`)."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_BSD)], dim=-1))
        return self.block(x_BSD, cos, sin, valid_BS)


def shift_left(x_BS: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """x[:, k:] followed by k `fill` values: what position i sees k tokens ahead (all `fill`
    when k ≥ S; the length stays S)."""
    B, S = x_BS.shape
    return torch.cat([x_BS[:, k:], x_BS.new_full((B, min(k, S)), fill)], dim=1)


class MultiTokenPrediction(nn.Module):
    def __init__(self, modules: list[MTPModule]):
        super().__init__()
        self.layers = nn.ModuleList(modules)

    def forward(self, h_BSD, input_ids_BS, labels_BS, embed: nn.Module, head: nn.Module, cos, sin,
                head_loss, valid_BS: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The loss of each depth k = 1..D, on the positions that have a target k tokens on; 0
        for a depth with none (`loss_or_zero`). `head_loss(head, h_BSD, targets_BS)`: the shared
        head's mean loss (train/loss.py). `valid_BS` is the trunk's mask of real tokens; each
        depth's MoE layers read `next_depth_valid` of the one before."""
        losses = []
        valid_BS = valid_mask(valid_BS, input_ids_BS.shape)
        for k, module in enumerate(self.layers, start=1):
            emb_BSD = embed(shift_left(input_ids_BS, k, fill=0))
            valid_BS = next_depth_valid(valid_BS)
            h_BSD = module(h_BSD, emb_BSD, cos, sin, valid_BS)
            targets_BS = shift_left(labels_BS, k, fill=IGNORE_INDEX)
            losses.append(loss_or_zero(head_loss(head, module.norm(h_BSD), targets_BS), targets_BS))
        return losses


def next_depth_valid(valid_BS: torch.Tensor | None) -> torch.Tensor | None:
    """The real positions of depth k from those of depth k − 1 (depth 0: the trunk's `valid_BS`).
    Depth k at position i has read h_i and the embeddings of tokens i+1..i+k, one per depth: it is
    real only if all of tokens i..i+k are, so depth k's mask is depth k − 1's and that mask one
    position on (for right padding, `valid & shift_left(valid, k)`). The k positions whose token
    i+k lies past the end (`shift_left`'s fill) are not real either: with a mask, depth k routes
    and counts the L − k positions of a sequence of L real tokens that DeepSeek-V3's module k runs
    on, however much padding follows them. Without a mask (the trainer's packed sequences) every
    position is routed, the k filled ones included, as in Megatron-Core (it rolls the ids)."""
    if valid_BS is None:
        return None
    return valid_BS & shift_left(valid_BS, 1, fill=False)


def loss_or_zero(loss: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """`loss`, or 0 when no position has a target (S ≤ k, or every label ignored), where the mean
    over no tokens is nan. Megatron-Core's MTP does the same (it clamps the depth's token count to
    1), and so does its next-token loss (`train/loss.py` uses this): such a depth adds 0 to the
    mean over depths, and its gradients are 0 (cross-entropy gives ignored positions none). A
    device-side choice, no host sync; with targets, `loss` itself, to the bit."""
    return torch.where((targets_BS != IGNORE_INDEX).any(), loss, 0.0)
