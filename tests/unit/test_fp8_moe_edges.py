"""Numeric and shape edges of the FP8 emulation and of the MoE layer, each against a naive reference.

M rows, K contraction dim, N output features, E experts, R routed rows.
"""

import pytest
import torch
from torch import nn

from moe_reference import build
from moefold.config import MoEConfig
from moefold.fp8.apply import _fp8_experts, _raise_pad_multiple
from moefold.fp8.gemm import EmulatedFp8Gemm, linear_scaling
from moefold.fp8.grouped import EmulatedFp8GroupedGemm, fake_quant_groups, grouped_scaling
from moefold.fp8.linear import Fp8Linear
from moefold.fp8.recipes import E4M3, E5M2, Operand, fake_quant
from moefold.fp8.saved import SaveInput
from moefold.fp8.weight_cache import PerCallWeights
from moefold.moe.balance import sequence_aux_loss
from moefold.moe.router import build_router

TINY = 1e-44  # an fp32 subnormal: amax · (1 / fp8_max) rounds to 0


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tile", ["tensor", "row", "col", "1x128", "128x1", "128x128"])
def test_a_tile_whose_scale_underflows_quantizes_to_zeros_not_nan(tile, fmt):
    """fp32 values below fp8_max · 2^-150 gave a scale of 0, and the tile's zeros 0 / 0 = NaN."""
    x = torch.zeros(128, 128)
    x[0, 0] = TINY
    back = fake_quant(x, Operand(tile, fmt), torch.float32)
    assert torch.equal(back, torch.zeros_like(x))  # flushed: a scale of 1 carries nothing this small


def test_group_columns_whose_scale_underflows_quantize_to_zeros_not_nan():
    """The experts' weight-gradient operands: one scale per column within each group."""
    x_RN = torch.zeros(32, 4)
    x_RN[0, 0], x_RN[16:] = TINY, 1.0  # group 0's first column: one tiny value among zeros
    back_RN = fake_quant_groups(x_RN, torch.tensor([16, 32]), Operand("col"), torch.float32)
    assert torch.equal(back_RN, torch.where(torch.arange(32)[:, None] < 16, 0.0, x_RN))


# ------------------------------------------------------------------------ empty batches


def empty_batch_layer(dim=16, **overrides):
    """A layer with the aux losses on but the sequence one (whose batch size an empty batch sets to 0)."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=dim, experts_backend="loop", aux_loss_coeff=0.1,
                    z_loss_coeff=0.1, global_aux_loss_coeff=0.1, **overrides)
    return build(cfg, dim, seed=0)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_an_empty_batch_passes_through_padded_groups(training, memory_efficient):
    """A data rank left no validation sequence (fewer than dp of them, `val_batches`' data_rank) runs
    the layer on B = 0: its padded groups still have rows, which gathered from no tokens."""
    layer = empty_batch_layer(pad_multiple=8, memory_efficient_permute=memory_efficient).train(training)
    x_BSD = torch.randn(0, 5, 16, dtype=torch.float64, requires_grad=True)
    y_BSD = layer(x_BSD)
    assert y_BSD.shape == x_BSD.shape
    y_BSD.sum().backward()
    assert x_BSD.grad.shape == x_BSD.shape
    assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_an_empty_batch_passes_through_fp8_linears(recipe):
    """The same data rank with FP8: quantizing no rows (tiles of 0 rows) divided by zero."""
    gemm, scaling = EmulatedFp8Gemm(), linear_scaling(recipe)
    linear = Fp8Linear.from_linear(nn.Linear(128, 256, bias=False), gemm, scaling)
    x_BSK = torch.randn(0, 5, 128, requires_grad=True)
    y_BSN = linear(x_BSK)
    assert y_BSN.shape == (0, 5, 256)
    y_BSN.sum().backward()
    assert x_BSK.grad.shape == x_BSK.shape
    assert torch.equal(linear.weight.grad, torch.zeros(256, 128))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_an_empty_batch_passes_through_fp8_experts(recipe, pad_to_capacity):
    """Padded groups (rows of zeros) or, padded to a capacity of 0, no rows at all."""
    layer = empty_batch_layer(128, capacity_factor=1.0, pad_to_capacity=pad_to_capacity).float()
    scaling = grouped_scaling(recipe)
    layer.experts = _fp8_experts(layer.experts, EmulatedFp8GroupedGemm(), scaling, SaveInput(), PerCallWeights())
    _raise_pad_multiple(layer, scaling.row_multiple)
    x_BSD = torch.randn(0, 5, 128, requires_grad=True)
    y_BSD = layer(x_BSD)
    assert y_BSD.shape == x_BSD.shape
    y_BSD.sum().backward()
    assert not layer.experts.w2_EFD.grad.any()


def test_an_empty_batch_trains_with_the_sequence_aux_loss():
    """B = 0 sequences: view(0, -1) of no tokens is ambiguous. The trainer gives each data rank
    train.micro_batch_size ≥ 1 rows, so only a direct caller met it; the loss of no sequence is 0."""
    layer = empty_batch_layer(seq_aux_loss_coeff=0.1).train()
    x_BSD = torch.randn(0, 5, 16, dtype=torch.float64, requires_grad=True)
    layer(x_BSD).sum().backward()
    assert not layer.router.weight.grad.any()
    scores_TE = torch.rand(0, 4)
    assert sequence_aux_loss(scores_TE, torch.zeros(0, 2, dtype=torch.int64), 0) == 0
    with pytest.raises(ValueError, match="do not split into batch_size=0"):
        sequence_aux_loss(torch.rand(3, 4), torch.zeros(3, 2, dtype=torch.int64), 0)


# ------------------------------------------------------------------------ routing


def test_softmax_top_k_chosen_by_the_expert_bias_with_underflowed_scores_is_not_nan():
    """Aux-loss-free balancing on a softmax router: the bias picks expert 1, whose softmax score
    underflowed to 0 (its logit 120 below expert 0's), and renormalising the top-1 gave 0/0."""
    cfg = MoEConfig(num_experts=2, top_k=1, expert_bias=True, aux_loss_coeff=0.0)
    router = build_router(4, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[30.0, 0, 0, 0], [0, 0, 0, 0]]))
        router.expert_bias_E.copy_(torch.tensor([0.0, 1.5]))
    routing = router(torch.tensor([[4.0, 0, 0, 0], [0.1, 0, 0, 0]]))
    assert routing.idx_TK.tolist() == [[1], [1]]
    assert routing.probs_TK[0].item() == 0.0  # nothing left to renormalise, as with sigmoid scores
    assert routing.probs_TK[1].item() == 1.0  # a top-1 of any other token still weighs 1
    routing.probs_TK.sum().backward()
    assert torch.isfinite(router.weight.grad).all()
