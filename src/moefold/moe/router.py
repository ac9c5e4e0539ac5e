"""Top-k token-choice router with the micro-batch load-balancing loss.

T tokens, D model dim, E experts, K top-k.
The router runs in fp32 whatever the autocast state: routing decisions are sensitive to rounding,
and the logits are a tiny GEMM.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    probs_TK: torch.Tensor  # fp32 combine weights of the chosen experts
    idx_TK: torch.Tensor  # int64 expert ids
    tokens_per_expert_E: torch.Tensor  # int64 routed copies per expert (no host sync)
    aux_loss: torch.Tensor  # fp32 scalar, unweighted


def switch_aux_loss(scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard load-balancing loss, E · Σ_e f_e · P_e, which is 1.0 for perfectly even routing.

    f_e = fraction of the T·K routed copies that went to expert e,
    P_e = mean router probability of expert e over the T tokens.
    """
    T, E = scores_TE.shape
    fraction_E = tokens_per_expert_E.float() / (T * top_k)
    mean_prob_E = scores_TE.mean(dim=0)
    return E * (fraction_E * mean_prob_E).sum()


class TopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.softmax(dim=-1)
        probs_TK, idx_TK = torch.topk(scores_TE, k=self.top_k, dim=-1)
        if self.norm_topk_prob:
            probs_TK = probs_TK / probs_TK.sum(dim=-1, keepdim=True)
        tokens_per_expert_E = count_tokens_per_expert(idx_TK, self.num_experts)
        aux_loss = switch_aux_loss(scores_TE, tokens_per_expert_E, self.top_k)
        return Routing(probs_TK, idx_TK, tokens_per_expert_E, aux_loss)


def count_tokens_per_expert(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed copies per expert. scatter_add_ rather than bincount: bincount syncs with the host."""
    idx_N = idx_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_N.device)
    return counts_E.scatter_add_(0, idx_N, torch.ones_like(idx_N))


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends `weight` as the gradient of `aux_loss`.

    This adds `weight · aux_loss` to the training objective without the layer returning the loss,
    so blocks (and later pipeline stages) keep a single tensor output.
    """

    @staticmethod
    def forward(ctx, x, aux_loss, weight: float):
        ctx.weight = weight
        ctx.save_for_backward(aux_loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (aux_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux_loss, ctx.weight), None


def inject_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, weight: float) -> torch.Tensor:
    return _InjectAuxLoss.apply(x, aux_loss, weight)
