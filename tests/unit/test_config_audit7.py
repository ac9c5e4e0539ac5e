"""Config coherence and the MoE layer's input errors (audit 7).

A [T, D] input with the sequence aux loss on is refused as moefold's own error; the balancer's own
counts (no counts given) drop nothing, padding or not; and the options found inert only in
degenerate contexts that workflows reach on purpose (round-robin routing of a real preset, a
one-step smoke test) are accepted, for the reasons their docs give."""

import random

import pytest
import torch

from moefold.config import MoEConfig, load_config
from moefold.errors import UserError
from moefold.moe.balance import LoadBalancer, LocalCounts
from moefold.moe.layer import build_moe_layer
from moefold.moe.router import Router
from moefold.optim.schedule import cosine, wsd


# ----------------------------------------------------------------------------- the layer's input


def _layer(**options) -> torch.nn.Module:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend="loop", **options)
    return build_moe_layer(8, moe, "cpu", torch.float32).train()


def test_a_token_matrix_with_the_sequence_aux_loss_is_a_user_error_naming_the_option():
    """It was a bare ValueError: the CLI's one-line report (UserError, exit 2) missed it."""
    layer = _layer(aux_loss_coeff=0.0, seq_aux_loss_coeff=0.01)
    with pytest.raises(UserError) as err:
        layer(torch.randn(6, 8))
    message = str(err.value)
    assert "moe.seq_aux_loss_coeff=0.01" in message and "[B, S, D]" in message and "[6, 8]" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- the balancer's counts


def _naive_dropped(idx_TK: torch.Tensor, keep_N: torch.Tensor, valid_T: torch.Tensor | None) -> int:
    """Valid (token, k) copies the capacity did not keep, one by one."""
    T, K = idx_TK.shape
    return sum(1 for t in range(T) for k in range(K)
               if (valid_T is None or bool(valid_T[t])) and not bool(keep_N[t * K + k]))


@pytest.mark.parametrize("seed", range(8))
def test_local_counts_drop_only_valid_copies_not_kept(seed):
    """`dropped` counts the real copies the capacity left out, whatever keep_N says of padding."""
    gen = torch.Generator().manual_seed(seed)
    T, K, E = 12, 2, 4
    idx_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    keep_N = torch.rand(T * K, generator=gen) < 0.7
    valid_T = torch.rand(T, generator=gen) < 0.6
    for valid in (None, valid_T):
        counts = LocalCounts()(idx_TK, keep_N, E, valid)
        assert int(counts.dropped) == _naive_dropped(idx_TK, keep_N, valid)


def test_the_balancer_counting_alone_drops_nothing_with_padding():
    """LoadBalancer.forward(counts=None) counts its micro-batch with nothing dropped: with padding
    it made `dropped` minus the padded copies (-4 for 2 padded tokens of top-2)."""
    cfg = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.01)
    router, balancer = Router(8, cfg), LoadBalancer(cfg)
    torch.nn.init.normal_(router.weight)
    seen = []
    name, coeff, loss_fn = balancer.terms[0]
    balancer.terms = [(name, coeff, lambda *args: seen.append(args[3]) or loss_fn(*args))]
    valid_T = torch.tensor([True, True, False, True, False, True])
    routing = router(torch.randn(6, 8))
    balancer(routing, 1, valid_T)
    assert int(seen[0].dropped) == 0
    assert seen[0].per_expert_E.tolist() == torch.bincount(routing.idx_TK[valid_T].reshape(-1), minlength=4).tolist()
