"""The MoE layer: router → dispatcher.dispatch → experts → dispatcher.combine.

B batch, S sequence, T = B·S tokens, D model dim, E experts.
"""

import contextlib

import torch
from torch import nn

from moefold.moe.dispatch import LocalDispatcher
from moefold.moe.experts import Experts
from moefold.moe.router import TopKRouter, inject_aux_loss


class MoELayer(nn.Module):
    def __init__(self, router: TopKRouter, experts: Experts, dispatcher: LocalDispatcher,
                 aux_loss_coeff: float):
        super().__init__()
        self.router, self.experts, self.dispatcher = router, experts, dispatcher
        self.aux_loss_coeff = aux_loss_coeff
        self.aux_loss_scale = 1.0  # 1 / micro-batches per step, set by the trainer
        # Statistics accumulate on the device (no sync) until the trainer reads and resets them.
        self.register_buffer("load_counts_E", torch.zeros(router.num_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("forward_count", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD)
        x_ND, tokens_per_expert_E, handle = self.dispatcher.dispatch(x_TD, routing)
        y_ND = self.experts(x_ND, tokens_per_expert_E)
        y_TD = self.dispatcher.combine(y_ND, handle).to(x_BSD.dtype)
        y_TD = inject_aux_loss(y_TD, routing.aux_loss, self.aux_loss_coeff * self.aux_loss_scale)
        self._record(routing.tokens_per_expert_E, routing.aux_loss)
        return y_TD.view_as(x_BSD)

    @torch.no_grad()
    def _record(self, tokens_per_expert_E: torch.Tensor, aux_loss: torch.Tensor) -> None:
        self.load_counts_E += tokens_per_expert_E
        self.aux_loss_sum += aux_loss.detach()
        self.forward_count += 1

    @torch.no_grad()
    def pop_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens per expert, mean aux loss) since the last call; resets the accumulators."""
        counts_E = self.load_counts_E.clone()
        mean_aux = self.aux_loss_sum / self.forward_count.clamp(min=1)
        self.load_counts_E.zero_()
        self.aux_loss_sum.zero_()
        self.forward_count.zero_()
        return counts_E, mean_aux


@contextlib.contextmanager
def frozen_stats(layers: list[MoELayer]):
    """Forwards inside (validation, generation) leave the layers' training statistics unchanged."""
    saved = [(l.load_counts_E.clone(), l.aux_loss_sum.clone(), l.forward_count.clone()) for l in layers]
    try:
        yield
    finally:
        for layer, (counts, aux, n) in zip(layers, saved):
            layer.load_counts_E.copy_(counts)
            layer.aux_loss_sum.copy_(aux)
            layer.forward_count.copy_(n)
