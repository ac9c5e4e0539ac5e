"""AdamW with decoupled weight decay on matrices only (not norms, biases or embeddings).

Precision-aware states (bf16/fp8 moments, bf16 master weights) arrive with the memory-wall work.
"""

import torch
from torch import nn

from moefold.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "tok_embeddings" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # fused on GPU (one kernel for all parameters); foreach on CPU, where fused gives no gain.
    fused = device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                             eps=t.eps, fused=fused, foreach=None if fused else True)
