"""Parameter counts and training FLOPs by Megatron's convention.

Training FLOPs per token = 6 · active parameters (every matrix a token passes through, the output
head included, the embedding lookup excluded; a routed expert counts K/E of its weights)
+ causal attention: 3 · L · S · H · (Dh_qk + Dh_v)  (QKᵀ and AV, forward 2·S·H·Dh each, halved by
the causal mask, times 3 for forward + backward). docs/metrics.md derives it.
"""

from dataclasses import dataclass

import torch
from torch import nn

from moefold.moe.experts import Experts

# Datasheet dense bf16 TFLOP/s (no sparsity) by device-name fragment, for MFU.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0,
                    "B200": 2250.0, "GB200": 2500.0, "B300": 2500.0, "GB300": 2500.0, "L40S": 362.0}


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every distinct parameter
    active: int  # what one token multiplies by: routed experts scaled by K/E, no embedding lookup
    embedding: int


def count_params(model: nn.Module) -> ParamCounts:
    top_k = model.cfg.moe.top_k
    total = active = 0
    counted: set[int] = set()
    experts_params = {id(p): m.num_experts for m in model.modules() if isinstance(m, Experts)
                      for p in m.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in counted:
            continue
        counted.add(id(p))
        total += p.numel()
        if id(p) in experts_params:
            active += p.numel() * top_k // experts_params[id(p)]
        elif not name.startswith("tok_embeddings") or model.cfg.model.tie_embeddings:
            active += p.numel()  # a tied embedding is counted once, as the output head
    embedding = model.tok_embeddings.weight.numel()
    return ParamCounts(total=total, active=active, embedding=embedding)


def attention_flops_per_token(n_layers: int, seq_len: int, n_heads: int, qk_head_dim: int,
                              v_head_dim: int) -> int:
    """Causal-halved forward+backward FLOPs of QKᵀ and AV, per token."""
    return 3 * n_layers * seq_len * n_heads * (qk_head_dim + v_head_dim)


def train_flops_per_token(model: nn.Module, seq_len: int) -> int:
    m = model.cfg.model
    head_dim = m.head_dim or m.dim // m.n_heads
    return (6 * count_params(model).active
            + attention_flops_per_token(m.n_layers, seq_len, m.n_heads, head_dim, head_dim))


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """Peak dense bf16 TFLOP/s of one device for MFU: the configured value, else a datasheet lookup
    by GPU name; None on CPU or an unknown GPU."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [k for k in PEAK_BF16_TFLOPS if k in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None
