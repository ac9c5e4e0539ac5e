"""A batch of no tokens through the CUDA kernels: a data rank given no validation sequence (fewer
of them than dp, `val_batches`' data_rank) runs every layer on B = 0. The CPU twins are tested in
test_fp8_moe_edges; here torch._grouped_mm, cuBLAS/CUTLASS scaled GEMMs and the Triton kernels
meet zero rows (and groups of zero rows padded to the FP8 alignment)."""

import pytest
import torch
from torch import nn

from moefold.config import MoEConfig
from moefold.fp8.apply import _fp8_experts, _raise_pad_multiple
from moefold.fp8.gemm import ScaledMMFp8Gemm, linear_scaling
from moefold.fp8.grouped import build_grouped_gemm, grouped_scaling
from moefold.fp8.linear import Fp8Linear
from moefold.fp8.saved import SaveInput
from moefold.fp8.weight_cache import PerCallWeights
from moefold.moe.layer import build_moe_layer

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DIM = 128


def moe_layer(**overrides):
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=DIM, aux_loss_coeff=0.1, z_loss_coeff=0.1,
                    global_aux_loss_coeff=0.1, **overrides)
    return build_moe_layer(DIM, cfg, "cuda", torch.bfloat16).to("cuda", torch.bfloat16)


def assert_empty_batch_passes(layer, dtype=torch.bfloat16):
    """Forward and backward of B = 0: outputs and input gradients of the right (empty) shape, no
    parameter gradient but zeros."""
    x_BSD = torch.randn(0, 5, DIM, device="cuda", dtype=dtype, requires_grad=True)
    y_BSD = layer(x_BSD)
    assert y_BSD.shape == x_BSD.shape
    y_BSD.float().sum().backward()
    torch.cuda.synchronize()
    assert x_BSD.grad.shape == x_BSD.shape
    assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("pad_multiple", [0, 16])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_an_empty_batch_passes_through_the_moe_layer(backend, pad_multiple, memory_efficient):
    layer = moe_layer(experts_backend=backend, pad_multiple=pad_multiple,
                      memory_efficient_permute=memory_efficient).train()
    assert_empty_batch_passes(layer)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="FP8 GEMMs need sm90+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_an_empty_batch_passes_through_fp8_linears(recipe):
    linear = nn.Linear(DIM, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    assert_empty_batch_passes(nn.Sequential(Fp8Linear.from_linear(linear, ScaledMMFp8Gemm(), linear_scaling(recipe)),
                                            nn.Linear(256, DIM, bias=False, device="cuda", dtype=torch.bfloat16)))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="FP8 GEMMs need sm90+")
@pytest.mark.parametrize("pad_to_capacity", [False, True])
@pytest.mark.parametrize("kernel,recipe", [("triton", "rowwise"), ("triton", "blockwise"), ("cutlass", "rowwise")])
def test_an_empty_batch_passes_through_fp8_experts(kernel, recipe, pad_to_capacity):
    layer = moe_layer(capacity_factor=1.0, pad_to_capacity=pad_to_capacity).train()
    scaling = grouped_scaling(recipe)
    gemm = build_grouped_gemm("cuda", kernel, "fp8", recipe)
    layer.experts = _fp8_experts(layer.experts, gemm, scaling, SaveInput(), PerCallWeights())
    _raise_pad_multiple(layer, scaling.row_multiple)
    assert_empty_batch_passes(layer)
