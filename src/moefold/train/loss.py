"""Training objectives. B batch, S sequence, V vocabulary.

An objective is chosen when the trainer is built: next-token cross-entropy, plus the
multi-token-prediction losses when the model has MTP modules. Each returns the total to
differentiate and the parts to log (`lm_loss` is always the plain next-token loss, so runs with
and without MTP compare).
"""

import torch
import torch.nn.functional as F

from moefold.train.chunked_loss import chunked_linear_cross_entropy


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (bf16 logits lose too much in the log-sum-exp);
    labels of -100 are ignored."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())


def next_token_loss(model, input_ids_BS, labels_BS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = cross_entropy_loss(model(input_ids_BS), labels_BS)
    return loss, {"lm_loss": loss.detach()}


class NextTokenAndMTPLoss:
    """L = L_lm + weight · mean_k L_mtp,k (DeepSeek-V3, λ = 0.3 early in training, 0.1 later)."""

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, model, input_ids_BS, labels_BS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h_BSD, (cos, sin) = model.trunk(input_ids_BS)
        lm_loss = cross_entropy_loss(model.output(model.norm(h_BSD)), labels_BS)
        mtp_losses = model.mtp(h_BSD, input_ids_BS, labels_BS, model.tok_embeddings, model.output,
                               cos, sin, cross_entropy_loss)
        mtp_loss = torch.stack(mtp_losses).mean()
        return lm_loss + self.weight * mtp_loss, {"lm_loss": lm_loss.detach(),
                                                  "mtp_loss": mtp_loss.detach()}


class ChunkedNextTokenLoss:
    """Next-token loss through the chunked head + cross-entropy (no `[T, V]` logits kept)."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def __call__(self, model, input_ids_BS, labels_BS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h_BSD, _ = model.trunk(input_ids_BS)
        loss = chunked_linear_cross_entropy(model.norm(h_BSD), model.output.weight, labels_BS,
                                            self.chunk_tokens)
        return loss, {"lm_loss": loss.detach()}


def build_objective(model, chunk_tokens: int = 0):
    """`chunk_tokens` > 0 (train.loss_chunk_tokens) picks the chunked head + loss for models
    without MTP."""
    if model.mtp is not None:
        return NextTokenAndMTPLoss(model.cfg.model.mtp_loss_weight)
    return ChunkedNextTokenLoss(chunk_tokens) if chunk_tokens > 0 else next_token_loss
