"""FP8 GEMMs on the GPU (cuBLAS / CUTLASS) against the CPU-tested emulation (moefold.fp8).

M tokens, K input features, N output features, R routed rows, E experts.
Both sides quantize with the same code (same FP8 values and scales), so they differ only in
accumulation order and the bf16 output rounding: compared within a few bf16 ulps of the output.
"""

import pytest
import torch

from moefold.fp8.gemm import EmulatedFp8Gemm, ScaledMMFp8Gemm, linear_scaling
from moefold.fp8.grouped import (
    EmulatedFp8GroupedGemm,
    ScaledGroupedMMFp8Gemm,
    fp8_grouped_mm,
    grouped_scaling,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("FP8 GEMMs need sm90+ (H100/H200)", allow_module_level=True)

RECIPES = ["tensorwise", "rowwise", "blockwise"]
GEMMS = ["forward", "grad_input", "grad_weight"]


def assert_bf16_close(actual, expected):
    # Same FP8 operands: only fp32 accumulation order and the bf16 output rounding differ.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7,
                               atol=2 ** -7 * expected.float().abs().max().item())


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_matches_emulation(recipe, gemm):
    M, K, N = 512, 1024, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    scaling = getattr(linear_scaling(recipe), gemm)
    out = ScaledMMFp8Gemm().mm(a, b, scaling, torch.bfloat16)
    ref = EmulatedFp8Gemm().mm(a, b, scaling, torch.bfloat16)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert_bf16_close(out, ref)


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_grouped_mm_matches_emulation_forward_backward(recipe):
    multiple = grouped_scaling(recipe).row_multiple
    sizes = [2 * multiple, 0, 5 * multiple, multiple]
    E, K, N = len(sizes), 512, 1024
    R = sum(sizes) + 3  # rows past the last group (as the MoE layer leaves them), R not aligned
    offsets_E = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(R, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    gy = torch.randn(R, N, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for gemm in (ScaledGroupedMMFp8Gemm(), EmulatedFp8GroupedGemm()):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_mm(xr, wr, offsets_E, gemm, grouped_scaling(recipe))
        y.backward(gy)
        results.append((y.detach()[:sum(sizes)], xr.grad[:sum(sizes)], wr.grad))
    for out, ref in zip(*results):
        assert_bf16_close(out, ref)


def test_fp8_training_step_runs_on_cuda(tmp_path):
    """A short bf16 + FP8 (rowwise) run of the tiny aligned Qwen3 through the trainer."""
    from moefold.cli import main

    args = ["train", "--run-dir", str(tmp_path / "run"), "--config", "tiny-qwen3",
            "--model.dim", "128", "--model.head_dim", "32", "--model.n_kv_heads", "4",
            "--moe.expert_hidden", "128", "--train.steps", "5", "--precision.fp8", "rowwise",
            "--train.device", "cuda", "--checkpoint.save_at_end", "false"]
    assert main(args) == 0
