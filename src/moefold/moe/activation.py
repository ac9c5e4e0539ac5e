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


def gelu(h_RF: torch.Tensor) -> torch.Tensor:
    return F.gelu(h_RF)


def relu2(h_RF: torch.Tensor) -> torch.Tensor:
    r_RF = F.relu(h_RF)
    return r_RF * r_RF  # not .square(): autocast runs pow in fp32


@dataclass(frozen=True)
class Activation:
    fn: Callable[..., torch.Tensor]
    num_inputs: int  # 2 for gated (gate, up), 1 for plain


ACTIVATIONS = {"swiglu": Activation(swiglu, 2), "gelu": Activation(gelu, 1), "relu2": Activation(relu2, 1)}


class _ActivationTimesProbs(torch.autograd.Function):
    """act(*inputs) · probs, saving only the inputs and probs; backward recomputes act."""

    @staticmethod
    def forward(ctx, fn, probs_R, *inputs_RF):
        ctx.fn = fn
        ctx.save_for_backward(probs_R, *inputs_RF)
        out_RF = fn(*inputs_RF)
        return (out_RF.float() * probs_R[:, None]).to(out_RF.dtype)

    @staticmethod
    def backward(ctx, grad_RF):
        probs_R, *inputs_RF = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (probs_R, *inputs_RF)]
            out_RF = ctx.fn(*leaves[1:])
            weighted_RF = (out_RF.float() * leaves[0][:, None]).to(out_RF.dtype)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(weighted_RF, wanted, grad_RF))
        return (None, *[next(grads) if t.requires_grad else None for t in leaves])


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
        self.fn, self.num_inputs = activation.fn, activation.num_inputs

    def __call__(self, probs_R: torch.Tensor, *inputs_RF: torch.Tensor) -> torch.Tensor:
        return _ActivationTimesProbs.apply(self.fn, probs_R, *inputs_RF)
