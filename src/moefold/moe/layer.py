"""The MoE layer: router → capacity → dispatcher.dispatch → experts → dispatcher.combine
(+ shared experts), with the load-balancing losses injected into backward.

B batch, S sequence, T = B·S tokens, D model dim, E experts, K top-k, N = T·K copies.
Every variant is a part given at build time (`build_moe_layer`); the forward reads top to bottom.
"""

import math

import torch
from torch import nn

from moefold.config import ModelConfig, MoEConfig, validate_moe
from moefold.errors import ConfigError, UserError
from moefold.models.init import init_weights_
from moefold.moe.activation import ACTIVATIONS
from moefold.moe.balance import LoadBalancer, LocalCounts
from moefold.moe.capacity import build_capacity, padded_capacity
from moefold.moe.dispatch import LocalDispatcher
from moefold.moe.experts import Experts, build_experts, compute_dtype
from moefold.moe.permute import RowLayout
from moefold.moe.recomputing import in_backward
from moefold.moe.replay import RouterReplay
from moefold.moe.router import Router, build_router, inject_aux_loss
from moefold.moe.shared import GatedSharedExperts, SharedExperts
from moefold.moe.stats import ExpertLoadStats


class LayerInputError(UserError, ValueError):
    """A tensor given to the MoE layer that its options cannot take: the caller's input (one line,
    exit status 2 from the CLI) and, as Python's own errors for a bad argument, a ValueError."""


class MoELayer(nn.Module):
    def __init__(self, router: Router, balancer: LoadBalancer, capacity, dispatcher: LocalDispatcher,
                 experts: Experts, shared: SharedExperts | None):
        super().__init__()
        self.router, self.balancer, self.capacity = router, balancer, capacity
        self.dispatcher, self.experts, self.shared = dispatcher, experts, shared
        self.num_experts, self.top_k = router.weight.shape[0], dispatcher.top_k
        # The sequence aux loss balances each sequence of the [B, S, D] input: its coefficient, or 0.
        self.seq_aux_loss_coeff = next((c for name, c, _ in balancer.terms if name == "seq_aux_loss"), 0.0)
        self.aux_loss_scale = 1.0  # 1 / micro-batches per optimizer step, set by the trainer
        # How routed copies are counted for balancing and statistics: this process's micro-batch,
        # or (DataParallelCounts, set by parallelization) summed over the data-parallel ranks.
        self.count_routed = LocalCounts()
        self.stats = ExpertLoadStats(self.num_experts)
        # Routed copies per expert since the last optimizer step, for the expert-bias update.
        self.register_buffer("step_tokens_per_expert_E", torch.zeros(self.num_experts, dtype=torch.int64),
                             persistent=False)

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and self.seq_aux_loss_coeff and x_BSD.dim() != 3:
            # [T, D] would read each token as a sequence of one: another objective, without a word.
            raise LayerInputError(f"MoELayer input of shape {list(x_BSD.shape)} with moe.seq_aux_loss_coeff="
                                  f"{self.seq_aux_loss_coeff}: the sequence aux loss needs [B, S, D] (give "
                                  "x[None] for one sequence)")
        valid_BS = valid_mask(valid_BS, x_BSD.shape[:-1])
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        valid_N = None if valid_BS is None else valid_BS.reshape(-1).repeat_interleave(self.top_k)
        routing = self.router(x_TD)
        keep_N = self.capacity(routing.idx_TK, routing.probs_TK, valid_N)
        if valid_N is not None:
            keep_N = keep_N & valid_N  # padding tokens never reach an expert
        # Tokens travel in the experts' compute dtype: a [T, D] cast instead of a [T·K, D] one.
        sent = self.dispatcher.dispatch(x_TD.to(compute_dtype(x_TD)), routing, keep_N)
        y_RD = self.experts(sent.x_RD, sent.rows_per_expert_E, sent.probs_R)
        y_TD = self.dispatcher.combine(y_RD, sent.handle)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD).float()
        y_TD = y_TD.to(x_BSD.dtype)
        if self.training:  # statistics and aux losses belong to training forwards only
            y_TD = self._balance(y_TD, routing, keep_N, x_BSD.shape[0], valid_BS)
        return y_TD.view_as(x_BSD)

    def _balance(self, y_TD, routing, keep_N, batch_size, valid_BS):
        valid_T = None if valid_BS is None else valid_BS.reshape(-1)
        counts = self.count_routed(routing.idx_TK, keep_N, self.num_experts, valid_T)
        aux_total, aux_values = self.balancer(routing, batch_size, valid_T, counts)
        self._record(counts, routing.scores_TE, aux_values, valid_T)
        return inject_aux_loss(y_TD, aux_total, self.aux_loss_scale)

    @torch.no_grad()
    def _record(self, counts, scores_TE, aux_values, valid_T) -> None:
        """Once per training forward: a recompute (memory/moe_tape.py) skips it and replays the
        routing, capacity and count decisions its forward taped. A recompute of torch's own
        (`checkpoint_wrapper`), which runs in backward, records nothing either."""
        if in_backward():
            return
        self.step_tokens_per_expert_E += counts.per_expert_E
        self.stats.record(counts.per_expert_E, scores_TE, counts.dropped, aux_values, valid_T)

    def init_weights(self, std: float, seed: int, residual_std: float | None = None) -> None:
        """As `Transformer.init_weights` draws the layer in a model: Normal(0, std), the
        down-projections Normal(0, residual_std) (default std / sqrt(2), a one-block model's
        std / sqrt(2 · n_layers)), buffers zero."""
        init_weights_(self, std, std / math.sqrt(2) if residual_std is None else residual_std, seed)

    @torch.no_grad()
    def on_optimizer_step(self) -> None:
        """Expert-bias update from this step's counts; reset the per-step accumulators."""
        self.router.update_expert_bias(self.step_tokens_per_expert_E)
        self.balancer.reset_global_counts()
        self.step_tokens_per_expert_E.zero_()


def valid_mask(valid_BS: torch.Tensor | None, shape_BS: torch.Size) -> torch.Tensor | None:
    """`valid_BS` (True or 1: a real token; False or 0: padding) as the bool mask the layer reads:
    a bool mask as it is, an integer one (Hugging Face's `attention_mask`) as `!= 0`. A floating
    mask is refused: an additive attention mask marks the tokens kept with 0, a 0/1 mask with 1,
    and nothing in the values says which it is. Checks dtypes and shapes only: no host sync."""
    if valid_BS is None:
        return None
    if valid_BS.shape != shape_BS:
        raise UserError(f"valid_BS has shape {list(valid_BS.shape)}; it must be the tokens' "
                        f"[B, S] = {list(shape_BS)}")
    if valid_BS.dtype == torch.bool:
        return valid_BS
    if valid_BS.is_floating_point() or valid_BS.is_complex():
        raise UserError(f"valid_BS has dtype {valid_BS.dtype}; allowed: torch.bool (True: a real "
                        "token) or an integer dtype (1: a real token, 0: padding)")
    return valid_BS != 0


def build_moe_layer(dim: int, moe: MoEConfig, device_type: str, compute_dtype: torch.dtype,
                    replay: RouterReplay | None = None, etp: int = 1, *,
                    init_std: float | None = ModelConfig.init_std, seed: int = 0) -> MoELayer:
    """`etp`: parallel.etp, the ranks each expert's hidden dimension will be split over. The
    weights are drawn by `MoELayer.init_weights(init_std, seed)`; init_std=None leaves them
    uninitialised (`build_model`, which initialises the whole model), as does the meta device."""
    for key in ("num_experts", "top_k", "expert_hidden"):  # 0 experts is a dense model's config, not a layer
        if getattr(moe, key) < 1:
            raise ConfigError(f"moe.{key}={getattr(moe, key)} must be > 0 for an MoE layer")
    validate_moe(moe)
    capacity = build_capacity(moe.num_experts, moe.capacity_factor, moe.drop_policy)
    layout = RowLayout(moe.num_experts, moe.top_k, moe.pad_multiple, capacity_of=padded_capacity(moe))
    experts = build_experts(moe.experts_backend, moe.num_experts, dim, moe.expert_hidden, device_type,
                            compute_dtype, moe.activation, moe.memory_efficient_permute, etp)
    layer = MoELayer(router=build_router(dim, moe, replay), balancer=LoadBalancer(moe),
                     capacity=capacity,
                     dispatcher=LocalDispatcher(moe.top_k, layout, moe.memory_efficient_permute),
                     experts=experts, shared=_build_shared(dim, moe))
    if init_std is not None and not layer.router.weight.is_meta:  # torch.empty held the allocator's bytes
        layer.init_weights(init_std, seed)
    return layer


def _build_shared(dim: int, moe: MoEConfig) -> SharedExperts | None:
    if moe.shared_experts == 0:
        return None
    hidden = moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden)
    cls = GatedSharedExperts if moe.shared_expert_gate else SharedExperts
    return cls(dim, hidden, ACTIVATIONS[moe.activation])
