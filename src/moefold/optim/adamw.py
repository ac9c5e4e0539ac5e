"""AdamW with decoupled weight decay on matrices only (not norms, biases or embeddings).

All-fp32 states use torch's fused (GPU) or foreach (CPU) AdamW; lower-precision moments or master
weights use `PrecisionAwareAdamW` (optim/precision.py).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moefold.config import OptimConfig, TrainConfig
from moefold.optim.precision import PrecisionAwareAdamW


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (but not embeddings) with weight decay, the rest without; each split into DTensor
    and plain parameters, which one foreach/fused kernel call cannot mix (replicated parameters
    beside EP/TP-sharded ones under parallel.data_parallel=ddp)."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2 and "tok_embeddings" not in name
        groups.setdefault((decay, isinstance(p, DTensor)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def build_optimizer(model: nn.Module, t: TrainConfig, device: torch.device,
                    o: OptimConfig | None = None) -> torch.optim.Optimizer:
    o = o or OptimConfig()
    if (o.exp_avg_dtype, o.exp_avg_sq_dtype, o.master_dtype) != ("fp32", "fp32", "fp32"):
        # Converts bf16-master parameters to bf16 in place: build it after the weights are set.
        return PrecisionAwareAdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                   eps=t.eps, weight_decay=t.weight_decay, exp_avg_dtype=o.exp_avg_dtype,
                                   exp_avg_sq_dtype=o.exp_avg_sq_dtype, master=o.master_dtype)
    # fused on GPU (one kernel for all parameters); foreach on CPU, where fused gives no gain.
    fused = device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                             eps=t.eps, fused=fused, foreach=None if fused else True)
