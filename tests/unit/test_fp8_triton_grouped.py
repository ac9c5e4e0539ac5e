"""The Triton FP8 grouped GEMMs (fp8/triton_grouped.py) off the GPU: the tile schedule's arithmetic,
the backend choice, and — where Triton is installed — the kernels themselves under Triton's CPU
interpreter, through the experts' autograd Function, against the emulation. (CI's CPU torch has no
Triton: there the interpreter test skips; tests/gpu/test_fp8_gpu.py runs them compiled on the H200.)"""

import pytest
import torch
from triton_interpreter import needs_triton, run_interpreted

from moefold.errors import ConfigError
from moefold.fp8.grouped import (
    EmulatedFp8GroupedGemm,
    TritonFp8GroupedGemm,
    build_grouped_gemm,
)
from moefold.fp8.triton_grouped import HAS_TRITON, _row_tile_ends, _row_tiles_bound


def test_row_tiles_count_each_experts_tiles_cumulatively():
    offsets_E = torch.tensor([32, 32, 200, 456], dtype=torch.int32)  # rows 32, 0, 168, 256
    assert _row_tile_ends(offsets_E, 128).tolist() == [1, 1, 3, 5]


def test_row_tile_bound_fits_a_cuda_grid():
    assert _row_tiles_bound(131072, 128, 128) == 1024 + 128
    with pytest.raises(ValueError, match="more than a CUDA grid holds"):
        _row_tiles_bound(65535 * 128, 8, 128)


def test_backend_choice():
    for recipe in ("rowwise", "blockwise"):  # off CUDA: the emulation
        assert type(build_grouped_gemm("cpu", "triton", recipe=recipe)) is EmulatedFp8GroupedGemm
    if not HAS_TRITON:
        with pytest.raises(ConfigError, match="fp8_grouped_gemm=triton needs the triton package"):
            TritonFp8GroupedGemm()


INTERPRETED = """
import torch
from moefold.fp8.grouped import (TORCH_COLUMNS, EmulatedFp8GroupedGemm, TritonBlockwiseFp8GroupedGemm,
                                 TritonFp8GroupedGemm, fp8_grouped_mm, fp8_grouped_mms, grouped_scaling)
# The GEMM kernels alone: the interpreter's fp32 -> fp8 cast is not the GPU's, so the Triton column
# quantizers (tested on their own in test_fp8_triton_quant.py) would not give the emulation's bytes.
TritonFp8GroupedGemm.columns = TORCH_COLUMNS
torch.manual_seed(0)
cases = [  # recipe, kernel, group sizes (multiples of the recipe's row multiple, one empty), widths
    ("rowwise", TritonFp8GroupedGemm, [32, 0, 160, 16, 48], (128, 1024)),  # narrow and wide tiles
    ("blockwise", TritonBlockwiseFp8GroupedGemm, [128, 0, 256, 128], (256,)),
]
for recipe, kernel, sizes, widths in cases:
    for N in widths:
        E, K = len(sizes), 256
        R = sum(sizes) + 21  # rows past the last group
        offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
        x = torch.randn(R, K, dtype=torch.bfloat16)
        x[:, :128] *= 64  # K blocks of different magnitude: blockwise scales must follow them
        w = torch.randn(E, K, N, dtype=torch.bfloat16) * 0.02
        gy = torch.randn(R, N, dtype=torch.bfloat16)
        results = []
        for gemm in (kernel(), EmulatedFp8GroupedGemm()):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fp8_grouped_mm(xr, wr, offsets_E, gemm, grouped_scaling(recipe))
            y.backward(gy)
            results.append((y.detach()[:sum(sizes)], xr.grad[:sum(sizes)], wr.grad))
        for name, out, ref in zip(("forward", "grad_input", "grad_weight"), *results):
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2 ** -7, (recipe, N, name, err)  # the same FP8 operands; bf16 rounding apart
    # Gate and up in one Function (x quantized once) against one call each: bit for bit.
    w3, gy3 = torch.randn(E, K, N, dtype=torch.bfloat16) * 0.02, torch.randn(R, N, dtype=torch.bfloat16)
    runs = []
    for joint in (True, False):
        xr, wr, w3r = (t.clone().requires_grad_() for t in (x, w, w3))
        gemm, s = kernel(), grouped_scaling(recipe)
        ys = (fp8_grouped_mms(xr, [wr, w3r], offsets_E, gemm, s) if joint
              else [fp8_grouped_mm(xr, v, offsets_E, gemm, s) for v in (wr, w3r)])
        torch.autograd.backward(ys, [gy, gy3])
        runs.append([ys[0].detach()[:sum(sizes)], ys[1].detach()[:sum(sizes)], xr.grad[:sum(sizes)],
                     wr.grad, w3r.grad])
    assert all(torch.equal(a, b) for a, b in zip(*runs)), recipe
print("ok")
"""


@needs_triton
def test_kernels_under_the_triton_interpreter_match_the_emulation():
    run_interpreted(INTERPRETED)
