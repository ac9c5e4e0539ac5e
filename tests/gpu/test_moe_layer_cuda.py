"""The MoE layer on the GPU, fp32 and bf16 autocast, against the fp64 per-token CPU reference."""

import dataclasses

import pytest
import torch

from moe_reference import build, random_config, reference_layer
from moefold.moe.experts import grouped_mm_supported

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}  # relative error norm


def close(a: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Relative error norm under tol; a gradient that is zero by construction (e.g. the router's
    when top-1 probabilities are renormalised to 1) only has to stay at rounding level."""
    a = a.double().cpu()
    return (a - ref).norm().item() <= tol * ref.norm().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("seed", range(16))
def test_layer_on_gpu_matches_fp64_reference(seed, backend, dtype):
    if backend == "grouped_mm" and not grouped_mm_supported("cuda", dtype):
        pytest.skip(f"torch._grouped_mm does not run {dtype} here")
    # GPU grouped GEMMs want 16-byte aligned rows: D and F multiples of 8.
    cfg = dataclasses.replace(random_config(seed), expert_hidden=16, experts_backend=backend)
    dim, T = 32, 64
    ref = build(cfg, dim, seed)
    layer = build(cfg, dim, seed).float().cuda()
    x = torch.randn(T, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    upstream = torch.randn(T, dim, dtype=torch.float64)

    x_ref = x.clone().requires_grad_()
    y_ref = reference_layer(x_ref, ref, cfg)
    (y_ref * upstream).sum().backward()

    x_gpu = x.float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        y = layer(x_gpu)
    (y.float() * upstream.float().cuda()).sum().backward()

    tol = TOLERANCE[dtype]
    assert close(y, y_ref, tol)
    assert close(x_gpu.grad, x_ref.grad, tol)
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert close(p.grad, p_ref.grad, tol), name


@pytest.mark.parametrize("memory_efficient", [True, False])
@pytest.mark.parametrize("pad_multiple", [0, 16])
def test_empty_experts_get_exact_zero_gradients_on_gpu(memory_efficient, pad_multiple):
    from moefold.config import MoEConfig

    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, aux_loss_coeff=0.0, pad_multiple=pad_multiple,
                    memory_efficient_permute=memory_efficient, experts_backend="auto")
    layer = build(cfg, 64, seed=0).float().cuda()
    with torch.no_grad():  # positive inputs never pick experts with negative router rows
        layer.router.weight[[1, 5, 6]] = -1.0
    torch.cuda.empty_cache()
    x = (torch.rand(512, 64, device="cuda") + 0.1).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for w in (layer.experts.w1_EDF, layer.experts.w3_EDF, layer.experts.w2_EFD):
        assert torch.isfinite(w.grad).all()
        assert w.grad[[1, 5, 6]].abs().sum() == 0
        assert w.grad[[0, 2, 3, 4, 7]].abs().sum() > 0
