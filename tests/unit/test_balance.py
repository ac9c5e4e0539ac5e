"""Load-balancing losses and z-loss on hand-checked numbers, padding, and the LoadBalancer module."""

import math

import pytest
import torch

from moefold.config import MoEConfig
from moefold.moe.balance import (LoadBalancer, global_batch_aux_loss, micro_batch_aux_loss,
                                 sequence_aux_loss, valid_tokens_per_expert, z_loss)
from moefold.moe.router import Routing

# Two sequences of two tokens, E=2, top-1. Sequence 0 routes both tokens to expert 0, sequence 1
# both to expert 1.
SCORES_TE = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.4, 0.6]])
IDX_TK = torch.tensor([[0], [0], [1], [1]])


def routing(scores_TE, idx_TK, logits_TE=None):
    logits_TE = scores_TE.log() if logits_TE is None else logits_TE
    return Routing(scores_TE.gather(-1, idx_TK), idx_TK, scores_TE, logits_TE)


def test_micro_batch_aux_loss_hand_checked():
    scores_TE = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    idx_TK = torch.tensor([[0], [0], [0], [1]])
    # f = [3/4, 1/4], P = [0.65, 0.35]: 2 · (0.75·0.65 + 0.25·0.35) = 2 · 0.575 = 1.15
    assert micro_batch_aux_loss(scores_TE, idx_TK).item() == pytest.approx(1.15)
    # top-2 over E=3: copies to experts 0,1 | 2,0 → counts [2, 1, 1] of 4, f = [0.5, 0.25, 0.25];
    # P = [0.35, 0.25, 0.4]: 3 · (0.175 + 0.0625 + 0.1) = 3 · 0.3375 = 1.0125
    scores_TE = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    assert micro_batch_aux_loss(scores_TE, torch.tensor([[0, 1], [2, 0]])).item() == pytest.approx(1.0125)


def test_balancing_losses_are_one_for_even_routing_with_uniform_scores():
    uniform_TE = torch.full((8, 4), 0.25)
    idx_TK = torch.tensor([[0, 1], [2, 3]] * 4)
    assert micro_batch_aux_loss(uniform_TE, idx_TK).item() == pytest.approx(1.0)
    assert sequence_aux_loss(uniform_TE, idx_TK, batch_size=4).item() == pytest.approx(1.0)
    counts_E = valid_tokens_per_expert(idx_TK, 4)
    assert global_batch_aux_loss(uniform_TE, idx_TK, counts_E, 8).item() == pytest.approx(1.0)


def test_sequence_loss_differs_from_micro_batch_loss():
    # Sequence 0: f = [1, 0], P = [0.8, 0.2] → 2 · 0.8 = 1.6; sequence 1: f = [0, 1],
    # P = [0.3, 0.7] → 2 · 0.7 = 1.4; mean 1.5.
    assert sequence_aux_loss(SCORES_TE, IDX_TK, batch_size=2).item() == pytest.approx(1.5)
    # The micro-batch as a whole looks balanced: f = [0.5, 0.5], P = [0.55, 0.45] → 2 · 0.5 = 1.0
    assert micro_batch_aux_loss(SCORES_TE, IDX_TK).item() == pytest.approx(1.0)


def test_sequence_loss_rejects_a_batch_size_that_does_not_divide_the_tokens():
    with pytest.raises(ValueError, match="batch_size=3"):
        sequence_aux_loss(SCORES_TE, IDX_TK, batch_size=3)


def test_z_loss_hand_checked():
    # logsumexp([0, 0]) = ln 2, logsumexp([ln 3, 0]) = ln 4 = 2 ln 2: mean((ln 2)², 4 (ln 2)²) = 2.5 (ln 2)²
    logits_TE = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert z_loss(logits_TE).item() == pytest.approx(2.5 * math.log(2.0) ** 2)
    assert z_loss(logits_TE.double()).dtype == torch.float32


def test_padding_is_excluded_from_every_loss():
    valid_T = torch.tensor([True, True, False, True, True, False])
    scores_TE = torch.rand(6, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    logits_TE = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    idx_TK = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2], [1, 3]])

    def losses(scores_TE, idx_TK, logits_TE):
        counts_E = valid_tokens_per_expert(idx_TK, 4, valid_T)
        return torch.stack([micro_batch_aux_loss(scores_TE, idx_TK, valid_T),
                            sequence_aux_loss(scores_TE, idx_TK, 2, valid_T),
                            global_batch_aux_loss(scores_TE, idx_TK, counts_E, 4, valid_T),
                            z_loss(logits_TE, valid_T)])

    before = losses(scores_TE, idx_TK, logits_TE)
    pad_T = ~valid_T
    scores2_TE = scores_TE.clone()
    scores2_TE[pad_T] = torch.tensor([0.97, 0.01, 0.01, 0.01])
    idx2_TK = idx_TK.clone()
    idx2_TK[pad_T] = torch.tensor([0, 1])
    logits2_TE = logits_TE.clone()
    logits2_TE[pad_T] = 1e4  # huge, but masked before logsumexp
    torch.testing.assert_close(losses(scores2_TE, idx2_TK, logits2_TE), before)

    # ... and each loss equals the one over the valid tokens alone.
    keep = valid_T.nonzero().squeeze(1)
    counts_E = valid_tokens_per_expert(idx_TK[keep], 4)
    unpadded = torch.stack([micro_batch_aux_loss(scores_TE[keep], idx_TK[keep]),
                            sequence_aux_loss(scores_TE[keep], idx_TK[keep], 2),
                            global_batch_aux_loss(scores_TE[keep], idx_TK[keep], counts_E, 4),
                            z_loss(logits_TE[keep])])
    torch.testing.assert_close(before, unpadded)


def test_fully_padded_sequence_is_left_out_of_the_sequence_average():
    valid_T = torch.tensor([True, True, False, False])
    # Only sequence 0 counts: 1.6 (see test_sequence_loss_differs_from_micro_batch_loss).
    assert sequence_aux_loss(SCORES_TE, IDX_TK, 2, valid_T).item() == pytest.approx(1.6)
    nothing_T = torch.zeros(4, dtype=torch.bool)
    assert sequence_aux_loss(SCORES_TE, IDX_TK, 2, nothing_T).item() == 0.0
    assert micro_batch_aux_loss(SCORES_TE, IDX_TK, nothing_T).item() == 0.0
    assert z_loss(SCORES_TE, nothing_T).item() == 0.0


def test_valid_tokens_per_expert():
    idx_TK = torch.tensor([[0, 1], [1, 2], [3, 1]])
    assert valid_tokens_per_expert(idx_TK, 4).tolist() == [1, 3, 1, 1]
    assert valid_tokens_per_expert(idx_TK, 4, torch.tensor([True, False, True])).tolist() == [1, 2, 0, 1]


def test_global_loss_equals_micro_batch_loss_with_one_micro_batch():
    balancer = LoadBalancer(MoEConfig(num_experts=2, top_k=1, aux_loss_coeff=0.0,
                                      global_aux_loss_coeff=1.0))
    scores_TE = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    idx_TK = torch.tensor([[0], [0], [0], [1]])
    _, values = balancer(routing(scores_TE, idx_TK), 2, None)
    assert values["global_aux_loss"].item() == pytest.approx(1.15)  # as in the micro-batch test


def test_global_loss_sees_the_whole_step_and_resets():
    balancer = LoadBalancer(MoEConfig(num_experts=2, top_k=1, aux_loss_coeff=1.0,
                                      global_aux_loss_coeff=1.0))
    first, second = routing(SCORES_TE[:2], IDX_TK[:2]), routing(SCORES_TE[2:], IDX_TK[2:])
    _, values = balancer(first, 1, None)  # all to expert 0: f = [1, 0], P = [0.8, 0.2] → 1.6
    assert values["global_aux_loss"].item() == pytest.approx(1.6)
    _, values = balancer(second, 1, None)
    # Micro-batch alone: f = [0, 1], P = [0.3, 0.7] → 1.4. The step so far: f = [0.5, 0.5] → 2 · 0.5 = 1.0
    assert values["aux_loss"].item() == pytest.approx(1.4)
    assert values["global_aux_loss"].item() == pytest.approx(1.0)
    assert balancer.global_counts_E.tolist() == [2, 2] and balancer.global_tokens.item() == 4

    balancer.reset_global_counts()
    _, values = balancer(second, 1, None)
    assert values["global_aux_loss"].item() == pytest.approx(1.4)


def test_evaluation_forwards_leave_the_global_counts_alone():
    balancer = LoadBalancer(MoEConfig(num_experts=2, top_k=1, global_aux_loss_coeff=1.0))
    balancer(routing(SCORES_TE[:2], IDX_TK[:2]), 1, None)
    balancer.eval()
    _, values = balancer(routing(SCORES_TE[2:], IDX_TK[2:]), 1, None)
    assert values["global_aux_loss"].item() == pytest.approx(1.0)  # this micro-batch counted ...
    assert balancer.global_counts_E.tolist() == [2, 0]  # ... but not stored
    assert "global_counts_E" not in balancer.state_dict()


def test_load_balancer_weighs_the_enabled_losses():
    cfg = MoEConfig(num_experts=2, top_k=1, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2,
                    global_aux_loss_coeff=0.3, z_loss_coeff=0.4)
    scores_TE = SCORES_TE.clone().requires_grad_()
    r = routing(scores_TE, IDX_TK, logits_TE=scores_TE.log())
    total, values = LoadBalancer(cfg)(r, 2, None)
    assert set(values) == {"aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss"}
    expected = (0.1 * values["aux_loss"] + 0.2 * values["seq_aux_loss"]
                + 0.3 * values["global_aux_loss"] + 0.4 * values["z_loss"])
    torch.testing.assert_close(total, expected)
    assert values["seq_aux_loss"].item() == pytest.approx(1.5)
    assert all(not v.requires_grad for v in values.values())
    total.backward()
    assert scores_TE.grad.abs().sum() > 0


def test_load_balancer_with_nothing_enabled_returns_zero():
    cfg = MoEConfig(num_experts=2, top_k=1, aux_loss_coeff=0.0)
    total, values = LoadBalancer(cfg)(routing(SCORES_TE, IDX_TK), 2, None)
    assert values == {} and total.item() == 0.0 and total.dtype == torch.float32
