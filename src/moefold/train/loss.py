"""Language-modelling loss. B batch, S sequence, V vocabulary."""

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (bf16 logits lose too much in the log-sum-exp)."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())
