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


def swiglu(gate_RF: torch.Tensor, up_RF: torch.Tensor) -> torch.Tensor:
    return F.silu(gate_RF) * up_RF


def swiglu_grad(grad_RF: torch.Tensor, gate_RF: torch.Tensor, up_RF: torch.Tensor):
    """d(silu(g)·u): silu'(g) = σ(g)·(1 + g·(1 − σ(g))). fp32 math, inputs' dtypes out."""
    g, u = gate_RF.float(), up_RF.float()
    sig = torch.sigmoid(g)
    return ((grad_RF * u * sig * (1 + g * (1 - sig))).to(gate_RF.dtype),
            (grad_RF * g * sig).to(up_RF.dtype))


def gelu(h_RF: torch.Tensor) -> torch.Tensor:
    return F.gelu(h_RF)


def gelu_grad(grad_RF: torch.Tensor, h_RF: torch.Tensor):
    """d gelu(h) = Φ(h) + h·φ(h) (the exact, erf form that F.gelu computes by default)."""
    h = h_RF.float()
    cdf = 0.5 * (1 + torch.erf(h * 0.7071067811865476))
    pdf = torch.exp(-0.5 * h * h) * 0.3989422804014327
    return ((grad_RF * (cdf + h * pdf)).to(h_RF.dtype),)


def relu2(h_RF: torch.Tensor) -> torch.Tensor:
    r_RF = F.relu(h_RF)
    return r_RF * r_RF  # not .square(): autocast runs pow in fp32


def relu2_grad(grad_RF: torch.Tensor, h_RF: torch.Tensor):
    return ((grad_RF * 2 * F.relu(h_RF.float())).to(h_RF.dtype),)


@dataclass(frozen=True)
class Activation:
    fn: Callable[..., torch.Tensor]
    num_inputs: int  # 2 for gated (gate, up), 1 for plain
    grad: Callable[..., tuple[torch.Tensor, ...]]
    """(grad of the output in fp32, *inputs) → grads of the inputs: a closed form, so backward
    needs no autograd.grad and torch.compile traces it."""


ACTIVATIONS = {"swiglu": Activation(swiglu, 2, swiglu_grad), "gelu": Activation(gelu, 1, gelu_grad),
               "relu2": Activation(relu2, 1, relu2_grad)}


class _ActivationTimesProbs(torch.autograd.Function):
    """act(*inputs) · probs, saving only the inputs and probs; backward recomputes act."""

    @staticmethod
    def forward(ctx, act: Activation, probs_R, *inputs_RF):
        ctx.act = act
        ctx.save_for_backward(probs_R, *inputs_RF)
        out_RF = act.fn(*inputs_RF)
        return (out_RF.float() * probs_R[:, None]).to(out_RF.dtype)

    @staticmethod
    def backward(ctx, grad_RF):
        probs_R, *inputs_RF = ctx.saved_tensors
        grad_probs_R = grad_inputs = None
        if ctx.needs_input_grad[1]:
            out_RF = ctx.act.fn(*inputs_RF)
            grad_probs_R = (grad_RF.float() * out_RF.float()).sum(dim=-1).to(probs_R.dtype)
        if any(ctx.needs_input_grad[2:]):
            grad_inputs = ctx.act.grad(grad_RF.float() * probs_R.float()[:, None], *inputs_RF)
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
