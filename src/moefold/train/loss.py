"""Training objectives. B batch, S sequence, V vocabulary.

An objective is chosen when the trainer is built: next-token cross-entropy, plus the
multi-token-prediction losses when the model has MTP modules. Each returns the total to
differentiate and the parts to log (`lm_loss` is always the plain next-token loss, so runs with
and without MTP compare). `valid_BS` (optional; the trainer's packed batches have no padding)
marks real tokens for the MoE layers of the trunk and of every MTP depth, as `model(ids,
valid_BS)` does; the loss reads only the labels (IGNORE_INDEX: ignored), so padding's labels must
be IGNORE_INDEX.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moefold.data.loader import IGNORE_INDEX
from moefold.models.mtp import loss_or_zero
from moefold.train.chunked_loss import (
    ChunkStep,
    chunk_loss_and_grad,
    chunked_linear_cross_entropy,
    fused_chunk_loss_and_grad,
    wide_dtype,
)
from moefold.train.compile import compile_loss


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (bf16 logits lose too much in the log-sum-exp), or in
    fp64 for fp64 logits; labels of IGNORE_INDEX are ignored."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).to(wide_dtype(logits_BSV.dtype)), labels_BS.flatten(),
                           ignore_index=IGNORE_INDEX)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LogitsLoss:
    """The output head's [B, S, V] logits, then `loss_fn` on them: `cross_entropy_loss`, or its
    compiled form under train.compile (train/compile.py)."""

    def __init__(self, loss_fn: LossFn = cross_entropy_loss):
        self.loss_fn = loss_fn

    def __call__(self, head: nn.Linear, h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(head(h_BSD), labels_BS)


class ChunkedLoss:
    """The head and cross-entropy `chunk_tokens` tokens at a time, never holding the [B, S, V]
    logits (train/chunked_loss.py; train.loss_chunk_tokens). `chunk_step`: each chunk's logits,
    loss and logits' gradient (`chunk_loss_and_grad`; under train.compile the compiled
    `fused_chunk_loss_and_grad`)."""

    def __init__(self, chunk_tokens: int, chunk_step: ChunkStep = chunk_loss_and_grad):
        self.chunk_tokens, self.chunk_step = chunk_tokens, chunk_step

    def __call__(self, head: nn.Linear, h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return chunked_linear_cross_entropy(h_BSD, head.weight, labels_BS, self.chunk_tokens, self.chunk_step)


HeadLoss = LogitsLoss | ChunkedLoss
"""(output head, final-normed hidden states, labels) → mean next-token loss over the labelled
positions: the trunk's head and every MTP depth's."""


def build_head_loss(chunk_tokens: int = 0, compiled: bool = False) -> HeadLoss:
    """`ChunkedLoss` for chunk_tokens > 0 (train.loss_chunk_tokens), else `LogitsLoss`; their
    elementwise work compiled when `compiled` (train.compile)."""
    if chunk_tokens > 0:
        return ChunkedLoss(chunk_tokens, compile_loss(fused_chunk_loss_and_grad) if compiled else chunk_loss_and_grad)
    return LogitsLoss(compile_loss(cross_entropy_loss) if compiled else cross_entropy_loss)


class NextTokenLoss:
    """L = cross-entropy of the model's next-token predictions; 0 (and no gradient) when every
    label is ignored, where the mean over no tokens is nan: Megatron-Core divides the
    micro-batch's summed loss by max(tokens, 1), as the chunked loss and the MTP depths do here."""

    def __init__(self, head_loss: HeadLoss | None = None):
        self.head_loss = head_loss or LogitsLoss()

    def __call__(self, model, input_ids_BS, labels_BS,
                 valid_BS=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h_BSD, _ = model.trunk(input_ids_BS, valid_BS)  # an FSDP forward method, as forward is
        loss = loss_or_zero(self.head_loss(model.output, model.norm(h_BSD), labels_BS), labels_BS)
        return loss, {"lm_loss": loss.detach()}


next_token_loss = NextTokenLoss()


class NextTokenAndMTPLoss:
    """L = L_lm + weight · mean_k L_mtp,k (DeepSeek-V3, λ = 0.3 early in training, 0.1 later).
    A depth k with no targets (sequences of S ≤ k tokens) has L_mtp,k = 0, as in Megatron-Core;
    L_lm is 0 with no labels, as `NextTokenLoss`'s. Every depth goes through `head_loss`."""

    def __init__(self, weight: float, head_loss: HeadLoss | None = None):
        self.weight, self.head_loss = weight, head_loss or LogitsLoss()

    def __call__(self, model, input_ids_BS, labels_BS,
                 valid_BS=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h_BSD, (cos, sin) = model.trunk(input_ids_BS, valid_BS)
        lm_loss = loss_or_zero(self.head_loss(model.output, model.norm(h_BSD), labels_BS), labels_BS)
        mtp_losses = model.mtp(h_BSD, input_ids_BS, labels_BS, model.tok_embeddings, model.output,
                               cos, sin, self.head_loss, valid_BS)
        mtp_loss = torch.stack(mtp_losses).mean()
        return lm_loss + self.weight * mtp_loss, {"lm_loss": lm_loss.detach(),
                                                  "mtp_loss": mtp_loss.detach()}


def build_objective(model, head_loss: HeadLoss | None = None):
    """The model's objective (with its MTP depths when it has them), every head through
    `head_loss` (default `LogitsLoss()`; the trainer's: `build_head_loss`)."""
    if model.mtp is not None:
        return NextTokenAndMTPLoss(model.cfg.model.mtp_loss_weight, head_loss)
    return NextTokenLoss(head_loss)
