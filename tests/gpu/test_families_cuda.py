"""Each tiny family model on the GPU (fp32 and bf16 autocast) against the same model on the CPU."""

import pytest
import torch

from moefold.config import load_config
from moefold.models.transformer import build_model
from moefold.train.loss import build_objective

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek", "tiny-mixtral", "tiny"])
def test_family_on_gpu_matches_cpu(preset, dtype, tol):
    cfg = load_config(preset)
    cpu = build_model(cfg, vocab_size=300)
    cpu.init_weights(seed=0)
    gpu = build_model(cfg, vocab_size=300, device_type="cuda", compute_dtype=dtype)
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))

    objective = build_objective(cpu)
    loss_cpu, _ = objective(cpu, ids, labels)
    loss_cpu.backward()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss_gpu, _ = objective(gpu, ids.cuda(), labels.cuda())
    loss_gpu.backward()

    assert abs(loss_gpu.item() - loss_cpu.item()) < tol * loss_cpu.item()
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.isfinite(p_gpu.grad).all(), name
        err = (p_gpu.grad.double().cpu() - p_cpu.grad.double()).norm()
        assert err <= 10 * tol * p_cpu.grad.double().norm() + 1e-6, name
