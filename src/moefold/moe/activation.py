"""Expert MLP activations, and their fusion with the routing probabilities.

R rows, F hidden. Gated activations (SwiGLU) take two projections (gate, up); plain ones one.
`ProbsInActivation` is the memory-efficient permutation of the Megatron-Core report: the routing
probability multiplies the activation output (before the down projection), and backward recomputes
the cheap elementwise activation instead of keeping its output, so neither the activation output nor
the down-projection output is saved for backward — only the `[R]` probabilities.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moefold.dtypes import cast


def swiglu(gate_RF: torch.Tensor, up_RF: torch.Tensor) -> torch.Tensor:
    return F.silu(gate_RF) * up_RF


def swiglu_grad(grad_RF: torch.Tensor, gate_RF: torch.Tensor, up_RF: torch.Tensor):
    return (torch.ops.aten.silu_backward(grad_RF * up_RF, gate_RF), grad_RF * F.silu(gate_RF))


def gelu(h_RF: torch.Tensor) -> torch.Tensor:
    return F.gelu(h_RF)


def gelu_grad(grad_RF: torch.Tensor, h_RF: torch.Tensor):
    return (torch.ops.aten.gelu_backward(grad_RF, h_RF),)


def relu2(h_RF: torch.Tensor) -> torch.Tensor:
    r_RF = F.relu(h_RF)
    return r_RF * r_RF  # not .square(): autocast runs pow in fp32


def relu2_grad(grad_RF: torch.Tensor, h_RF: torch.Tensor):
    half_RF = grad_RF * F.relu(h_RF)  # d(r·r) = grad·r + grad·r, each rounded as autograd does
    return (torch.where(h_RF > 0, half_RF + half_RF, 0),)


@dataclass(frozen=True)
class Activation:
    fn: Callable[..., torch.Tensor]
    num_inputs: int  # 2 for gated (gate, up), 1 for plain
    grad: Callable[..., tuple[torch.Tensor, ...]]
    """(grad of the output, *inputs) → grads of the inputs, by the same ops (and so the same
    roundings) as autograd through `fn`, written out so that backward needs no autograd.grad and
    torch.compile traces it."""


ACTIVATIONS = {"swiglu": Activation(swiglu, 2, swiglu_grad), "gelu": Activation(gelu, 1, gelu_grad),
               "relu2": Activation(relu2, 1, relu2_grad)}


class _ActivationTimesProbs(torch.autograd.Function):
    """act(*inputs) · probs, saving only the inputs and probs; backward recomputes act."""

    @staticmethod
    def forward(ctx, act: Activation, probs_R, *inputs_RF):
        ctx.act = act
        ctx.save_for_backward(probs_R, *inputs_RF)
        out_RF = act.fn(*inputs_RF)
        return cast(out_RF.float() * probs_R[:, None], out_RF.dtype)

    @staticmethod
    def backward(ctx, grad_RF):
        probs_R, *inputs_RF = ctx.saved_tensors
        grad_probs_R = grad_inputs = None
        if ctx.needs_input_grad[1]:
            out_RF = ctx.act.fn(*inputs_RF)
            grad_probs_R = cast((grad_RF.float() * out_RF.float()).sum(dim=-1), probs_R.dtype)
        if any(ctx.needs_input_grad[2:]):
            grad_out_RF = cast(grad_RF.float() * probs_R[:, None], inputs_RF[0].dtype)
            grad_inputs = ctx.act.grad(grad_out_RF, *inputs_RF)
        return (None, grad_probs_R, *(grad_inputs or [None] * len(inputs_RF)))


class PlainActivation:
    """act(*inputs); the probabilities are applied when the expert outputs are combined."""
    applies_probs = False

    def __init__(self, activation: Activation):
        self.fn, self.num_inputs = activation.fn, activation.num_inputs

    def __call__(self, probs_R: torch.Tensor, *inputs_RF: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs_RF)


class ProbsInActivation:
    """act(*inputs) · probs (memory-efficient permutation); combine then only sums."""
    applies_probs = True

    def __init__(self, activation: Activation):
        self.act, self.num_inputs = activation, activation.num_inputs

    def __call__(self, probs_R: torch.Tensor, *inputs_RF: torch.Tensor) -> torch.Tensor:
        return _ActivationTimesProbs.apply(self.act, probs_R, *inputs_RF)
