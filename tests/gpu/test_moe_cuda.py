"""The MoE layer on a CUDA GPU against the CPU fp64 reference (run on the H200 through the device tool)."""

import pytest
import torch

from moefold.moe.experts import GroupedMMExperts, LoopExperts, grouped_mm_supported

pytestmark = pytest.mark.gpu


def experts_pair(backend, E=8, D=64, F=32):
    torch.manual_seed(0)
    ref = LoopExperts(E, D, F).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    fast = backend(E, D, F).cuda()
    fast.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    return ref, fast


@pytest.mark.parametrize("backend", [GroupedMMExperts, LoopExperts], ids=lambda b: b.__name__)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-3)])
def test_experts_match_fp64_reference_with_empty_experts(backend, dtype, tol):
    if backend is GroupedMMExperts and not grouped_mm_supported("cuda", dtype):
        pytest.skip(f"torch._grouped_mm does not run {dtype} on this GPU")
    ref, fast = experts_pair(backend)
    tokens_per_expert_E = torch.tensor([40, 0, 17, 0, 0, 64, 3, 4])  # empty experts, uneven groups
    x_ND = torch.randn(int(tokens_per_expert_E.sum()), 64, dtype=torch.float64, requires_grad=True)
    g_ND = torch.randn_like(x_ND)
    ref(x_ND, tokens_per_expert_E).backward(g_ND)

    x_cuda = x_ND.detach().float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        y = fast(x_cuda, tokens_per_expert_E.cuda())
    y.backward(g_ND.cuda().to(y.dtype))  # bf16 under autocast

    def rel(a, b):
        return ((a.double().cpu() - b).norm() / b.norm()).item()

    assert rel(y, ref(x_ND.detach(), tokens_per_expert_E)) < tol
    assert rel(x_cuda.grad, x_ND.grad) < tol
    for (name, p_ref), p in zip(ref.named_parameters(), fast.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert rel(p.grad, p_ref.grad) < tol, name
        assert p.grad[[1, 3, 4]].abs().sum() == 0, name  # experts without tokens: exactly zero
