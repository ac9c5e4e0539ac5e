"""MoE layer variants against naive references written from their definitions (capacity: GShard /
Megatron-Core; sigmoid scores: DeepSeek-V3), for the cases the randomized layer test does not reach."""

import math
from fractions import Fraction

import pytest
import torch

from moefold.config import MoEConfig
from moefold.moe.capacity import expert_capacity
from moefold.moe.layer import build_moe_layer

# ------------------------------------------------------------------------------------ capacity


def naive_capacity(num_tokens: int, top_k: int, num_experts: int, factor: str) -> int:
    """ceil(factor · T·K / E) in exact rationals, the factor as the decimal a config writes, capped at T."""
    return min(num_tokens, math.ceil(Fraction(factor) * num_tokens * top_k / num_experts))


@pytest.mark.parametrize("factor", ["0.3", "0.7", "1.0", "1.1", "1.15", "1.2", "1.25", "1.3", "2.2", "1e30"])
def test_capacity_is_the_exact_ceiling_of_the_written_factor(factor):
    """In floating point 1.1 · 100·2 / 4 is 55.00000000000001: the ceiling gave 56."""
    for num_tokens in range(1, 260):
        for top_k, num_experts in ((1, 4), (2, 4), (2, 8), (6, 64), (8, 16)):
            assert (expert_capacity(num_tokens, top_k, num_experts, float(factor))
                    == naive_capacity(num_tokens, top_k, num_experts, factor)), (num_tokens, top_k, num_experts)


def _layer_routing_everything_to_experts_0_and_1(cfg: MoEConfig, dim: int):
    layer = build_moe_layer(dim, cfg, "cpu", torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 3.0, 2.0  # x[:, 0] > 0: experts 0, 1
    return layer


@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_an_overloaded_expert_keeps_exactly_its_capacity(pad_to_capacity):
    """T=100, K=2, E=4, factor 1.1: every token picks experts 0 and 1, each keeps C = 55 of its 100
    copies; the other 2·45 copies are dropped (a zero contribution)."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, capacity_factor=1.1, drop_policy="position",
                    pad_to_capacity=pad_to_capacity, aux_loss_coeff=0.0, experts_backend="loop")
    layer = _layer_routing_everything_to_experts_0_and_1(cfg, dim=8)
    x_TD = torch.randn(100, 8, generator=torch.Generator().manual_seed(1))
    x_TD[:, 0] = x_TD[:, 0].abs() + 0.5
    y_TD = layer(x_TD[None])[0]
    C = naive_capacity(100, 2, 4, "1.1")
    assert C == 55
    assert layer.stats.pop()["dropped"].item() == 2 * (100 - C)
    # By position: the first C tokens keep both copies, the rest keep none.
    assert (y_TD[:C].abs().sum(-1) > 0).all() and (y_TD[C:] == 0).all()


# ------------------------------------------------------------------------ sigmoid scores, padding


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("loss", ["aux_loss_coeff", "seq_aux_loss_coeff", "global_aux_loss_coeff"])
def test_a_padding_token_whose_sigmoid_scores_underflow_changes_no_gradient(loss, router_dtype):
    """A padding token with every router logit at -1000 (every sigmoid score 0) must train the
    layer as any other padding does: its balancing scores s / Σs were 0/0, and the NaN, masked out
    of the loss, still reached the router's and the input's gradients."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, score_func="sigmoid", router_dtype=router_dtype,
                    **{"aux_loss_coeff": 0.0, loss: 0.1}, experts_backend="loop")
    layer = build_moe_layer(4, cfg, "cpu", torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        layer.router.weight.copy_(torch.eye(4))  # logits = x
    valid_BS = torch.tensor([[True, True, True, False], [True, True, True, True]])
    x_BSD = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    grads = []
    for padding in (torch.zeros(4), torch.full((4,), -1000.0)):
        x = x_BSD.clone()
        x[0, 3] = padding
        x.requires_grad_()
        layer.zero_grad()
        (layer(x, valid_BS) * valid_BS[..., None]).sum().backward()
        grads.append([x.grad[valid_BS], *(p.grad for p in layer.parameters())])
    for underflow, ordinary in zip(grads[1], grads[0]):
        assert torch.isfinite(underflow).all()
        torch.testing.assert_close(underflow, ordinary, rtol=0, atol=0)
