"""The MoE layer with EP=1 makes no host sync in forward or backward (ARCHITECTURE principle 5):
`torch.cuda.set_sync_debug_mode("error")` turns any synchronising call into an error.

Under bf16 autocast, the way training runs on a GPU. (torch 2.11's fp32 `torch._grouped_mm` on
CUDA synchronises inside the op — seen on the H200 — so fp32 experts are not sync-free.)"""

import dataclasses

import pytest
import torch

from moe_reference import build, random_config
from moefold.moe.experts import grouped_mm_supported

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("seed", range(8))
def test_dropless_grouped_mm_layer_is_sync_free(seed, dtype):
    if not grouped_mm_supported("cuda", dtype):
        pytest.skip(f"torch._grouped_mm does not run {dtype} here")
    # Dropless and unpadded, in training mode (statistics and aux losses on): the EP=1 hot path.
    cfg = dataclasses.replace(random_config(seed), expert_hidden=16, experts_backend="grouped_mm",
                              capacity_factor=0.0, pad_to_capacity=False, pad_multiple=0,
                              aux_loss_coeff=0.01, z_loss_coeff=0.001)
    layer = build(cfg, 32, seed).float().cuda().train()
    x_BSD = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    upstream_BSD = torch.randn(2, 64, 32, device="cuda")
    layer(x_BSD)  # first call: lazy initialisation (cuBLAS handles, caches) may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            y_BSD = layer(x_BSD)
        (y_BSD.float() * upstream_BSD).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert x_BSD.grad is not None and torch.isfinite(x_BSD.grad).all()
