"""Config coherence and the MoE layer's input errors (audit 7).

A [T, D] input with the sequence aux loss on is refused as moefold's own error; the balancer's own
counts (no counts given) drop nothing, padding or not; and the options found inert only in
degenerate contexts that workflows reach on purpose (round-robin routing of a real preset, a
one-step smoke test) are accepted, for the reasons their docs give."""

import pytest
import torch

from moefold.config import MoEConfig
from moefold.errors import UserError
from moefold.moe.layer import build_moe_layer


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
