"""Token-choice top-k router: logits → scores → selection → combine weights.

T tokens, D model dim, E experts, K top-k, G expert groups (E/G experts each).

Every variant is a small strategy picked once, in `Router.__init__`, from the `MoEConfig`:
  jitter     UniformJitter (Switch Transformer) or none
  scores     SoftmaxScores (Qwen3, DeepSeek-V2), TopKThenSoftmax (Mixtral), SigmoidScores (DeepSeek-V3)
  selection  TopKSelection, GroupLimitedSelection (DeepSeek-V3), RoundRobinSelection (benchmarks),
             optionally wrapped by ReplayedSelection (router replay for RL, see replay.py)
  renorm     renormalise the chosen probabilities to sum 1, or keep them
The forward then reads as one straight path. The router runs in `router_dtype` with autocast off,
whatever the input dtype: the logits are a tiny GEMM and top-k decisions are sensitive to rounding.
No step syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moefold.config import MoEConfig
from moefold.dtypes import KeepsBufferDtypes
from moefold.moe.replay import WholeBatch

if TYPE_CHECKING:
    from moefold.moe.replay import RouterReplay

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Routing:
    probs_TK: torch.Tensor  # fp32 combine weights of the chosen experts (renormalised, scaled)
    idx_TK: torch.Tensor  # int64 chosen expert ids, distinct within a token
    scores_TE: torch.Tensor  # fp32 per-token distribution over all experts, for the aux losses
    logits_TE: torch.Tensor  # router logits in router_dtype, for the z-loss


# ---------------------------------------------------------------------------------------------
# Input jitter
# ---------------------------------------------------------------------------------------------


class TokenPlaces:
    """Where a router's T tokens sit in the global micro-batch ([B, S] flattened, as one process
    routes it): `data_rank`'s block of it (set by parallelization), within which the router holds
    `rows` of its TP group's batch (router replay's `WholeBatch`; under sequence parallelism
    `SequenceShardRows`, the rank's shard of each sequence, set by route_sequence_shard)."""

    def __init__(self):
        self.data_rank, self.rows = 0, WholeBatch()

    def __call__(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """[T] int64: each token's index in the global micro-batch."""
        group_tokens = self.rows.whole_tokens(num_tokens)
        group_places_N1 = torch.arange(group_tokens, device=device)[:, None]
        return self.data_rank * group_tokens + self.rows.mine(group_places_N1)[:, 0]


class UniformJitter:
    """Multiply the router input by U(1-eps, 1+eps) noise in training (Switch Transformer, §2.4).

    A token's noise is a hash of a key drawn once per call and of its place in the global
    micro-batch, so every layout gives each token the noise one process gives it, each rank
    computing only its own tokens'. (A draw in the shape of the rank's tokens would repeat the same
    noise on every data rank and sequence shard, whose RNGs are seeded alike.)"""

    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, x_TD: torch.Tensor, training: bool, places: TokenPlaces) -> torch.Tensor:
        if not training:
            return x_TD
        T, D = x_TD.shape
        key = torch.randint(2**32, (), device=x_TD.device)  # the same on every rank: RNGs seeded alike
        index_TD = places(T, x_TD.device)[:, None] * D + torch.arange(D, device=x_TD.device)
        u_TD = hashed_uniform(index_TD, key).to(x_TD.dtype)
        return x_TD * (1.0 - self.eps + 2.0 * self.eps * u_TD)


def no_jitter(x_TD: torch.Tensor, training: bool, places: TokenPlaces) -> torch.Tensor:
    return x_TD


_LOW32 = 0xFFFFFFFF


def hashed_uniform(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1) per non-negative int64 `index`: a counter-based draw (no RNG state, no
    host sync), 24 bits of a 32-bit hash of (key, index)."""
    h = _mix32(_mix32(key ^ (index >> 32)) ^ (index & _LOW32))
    return (h >> 8).float() * 2.0**-24


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' hash prospector), a bijection of 32 bits, in int64 arithmetic: the
    products wrap past 2^63 but their low 32 bits, all that is kept, are exact."""
    x = x & _LOW32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _LOW32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


# ---------------------------------------------------------------------------------------------
# Score functions: what the selection ranks, what the chosen experts weigh, what the aux losses see
# ---------------------------------------------------------------------------------------------


class SoftmaxScores:
    """softmax over all E experts, then top-k of the scores (Qwen3, DeepSeek-V2)."""

    # DeepSeek-V3's guard too: with an expert bias the top-k need not hold the best score, and the
    # chosen scores can all underflow to 0 (a logit 104 below the best in fp32), whose 0/0 was NaN.
    renorm_eps = 1e-20

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE.softmax(dim=-1)

    def selection(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
        return scores_TE

    def chosen(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
        return scores_TE.gather(-1, idx_TK)

    def balance(self, scores_TE: torch.Tensor) -> torch.Tensor:
        return scores_TE


class TopKThenSoftmax(SoftmaxScores):
    """top-k of the logits, then softmax over the K chosen (Mixtral). The aux losses still see the
    softmax over all E, as in Mixtral's load-balancing loss."""

    def selection(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE

    def chosen(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
        return logits_TE.gather(-1, idx_TK).softmax(dim=-1)


class SigmoidScores:
    """Independent sigmoid per expert (DeepSeek-V3)."""

    renorm_eps = 1e-20  # DeepSeek-V3's guard: sigmoid scores can all underflow to 0

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE.sigmoid()

    def selection(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
        return scores_TE

    def chosen(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
        return scores_TE.gather(-1, idx_TK)

    def balance(self, scores_TE: torch.Tensor) -> torch.Tensor:
        # DeepSeek-V3's sequence-wise loss uses the scores normalised to a distribution per token.
        # The guard: a token whose scores all underflow (a padding token's, masked in the losses)
        # gave 0/0, whose NaN reached the router's gradient through the mask.
        return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + self.renorm_eps)


ScoreFunction = SoftmaxScores | SigmoidScores


def build_score_function(cfg: MoEConfig) -> ScoreFunction:
    if cfg.score_func == "sigmoid":
        return SigmoidScores()
    return SoftmaxScores() if cfg.softmax_before_topk else TopKThenSoftmax()


# ---------------------------------------------------------------------------------------------
# Selection: the K expert ids of each token from the (biased) selection scores
# ---------------------------------------------------------------------------------------------

Selection = Callable[[torch.Tensor], torch.Tensor]  # selection_TE -> idx_TK


class TopKSelection:
    def __init__(self, top_k: int):
        self.top_k = top_k

    def __call__(self, selection_TE: torch.Tensor) -> torch.Tensor:
        return selection_TE.topk(self.top_k, dim=-1).indices


class GroupLimitedSelection:
    """DeepSeek-V3 node-limited routing: keep the `group_top_k` best of G contiguous expert groups,
    a group scoring by the sum of its best `experts_per_group_score` experts (Megatron:
    top_k/group_top_k; DeepSeek-V3's checkpoints: 2); top-k among the kept ones."""

    def __init__(self, top_k: int, num_groups: int, group_top_k: int, experts_per_group_score: int = 0):
        self.top_k, self.num_groups, self.group_top_k = top_k, num_groups, group_top_k
        self.experts_per_group_score = experts_per_group_score or top_k // group_top_k

    def __call__(self, selection_TE: torch.Tensor) -> torch.Tensor:
        T, E = selection_TE.shape
        selection_TGe = selection_TE.view(T, self.num_groups, E // self.num_groups)
        group_scores_TG = selection_TGe.topk(self.experts_per_group_score, dim=-1).values.sum(-1)
        kept_TG = group_scores_TG.topk(self.group_top_k, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_TG, True)
        # -inf, not DeepSeek's 0.0: biased sigmoid scores and logits can be negative, and a masked
        # 0 would then outrank them. The config guarantees K experts remain in the kept groups.
        masked_TE = selection_TGe.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)
        return masked_TE.topk(self.top_k, dim=-1).indices


class RoundRobinSelection:
    """Ignore the scores: token t gets experts (t·K + k) mod E, so every expert gets the same load
    when T·K is a multiple of E (benchmarks of a perfectly balanced MoE). t is the token's place in
    the global micro-batch (`places`, the router's), so every layout routes each token as one
    process does; its place among a data rank's or a sequence shard's own tokens would not."""

    def __init__(self, top_k: int, num_experts: int, places: TokenPlaces | None = None):
        self.top_k, self.num_experts = top_k, num_experts
        self.places = places or TokenPlaces()

    def __call__(self, selection_TE: torch.Tensor) -> torch.Tensor:
        device = selection_TE.device
        t_T1 = self.places(selection_TE.shape[0], device)[:, None]
        return (t_T1 * self.top_k + torch.arange(self.top_k, device=device)) % self.num_experts


class ReplayedSelection:
    """Hands the choice to a shared `RouterReplay`: live, recorded, or replayed (see replay.py).
    `rows`: which of the batch's tokens this router sees (all of them, unless sequence parallelism
    gives it a shard, parallel/sequence.py)."""

    def __init__(self, select: Selection, replay: RouterReplay, layer: int):
        self.select, self.replay, self.layer = select, replay, layer
        self.rows = WholeBatch()

    def __call__(self, selection_TE: torch.Tensor) -> torch.Tensor:
        return self.replay.route(self.layer, selection_TE, self.select, self.rows)


def build_selection(cfg: MoEConfig, places: TokenPlaces | None = None) -> Selection:
    """`places`: the router's token places, which round-robin routing reads."""
    if cfg.force_balanced:
        return RoundRobinSelection(cfg.top_k, cfg.num_experts, places)
    if cfg.num_groups > 1:
        return GroupLimitedSelection(cfg.top_k, cfg.num_groups, cfg.group_top_k, cfg.group_score_top_k)
    return TopKSelection(cfg.top_k)


# ---------------------------------------------------------------------------------------------
# Renormalisation of the chosen probabilities
# ---------------------------------------------------------------------------------------------


class Renormalize:
    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, probs_TK: torch.Tensor) -> torch.Tensor:
        return probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + self.eps)


def keep_probs(probs_TK: torch.Tensor) -> torch.Tensor:
    return probs_TK


# ---------------------------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------------------------


class Router(KeepsBufferDtypes):
    """Linear router `weight` [E, D] with the variants of `cfg` fixed at construction.

    With `cfg.expert_bias`, a persistent fp32 buffer `expert_bias_E` (aux-loss-free balancing,
    DeepSeek-V3's `e_score_correction_bias`) is added to the selection scores only, never to the
    combine weights. With `replay`, this router takes the next layer index of the shared
    `RouterReplay` (`self.replay_layer`) and its selection can be recorded or replayed.
    """

    def __init__(self, dim: int, cfg: MoEConfig, replay: RouterReplay | None = None):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router_dtype = ROUTER_DTYPES[cfg.router_dtype]
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.expert_bias_update_rate = cfg.expert_bias_update_rate
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))

        self.jitter = UniformJitter(cfg.input_jitter) if cfg.input_jitter > 0 else no_jitter
        self.token_places = TokenPlaces()  # the jitter's and round-robin's: set by parallelization
        self.score_fn = build_score_function(cfg)
        self.select = build_selection(cfg, self.token_places)
        self.replay_layer = None
        if replay is not None:
            self.replay_layer = replay.register(cfg.top_k, cfg.num_experts)
            self.select = ReplayedSelection(self.select, replay, self.replay_layer)
        self.renormalize = Renormalize(self.score_fn.renorm_eps) if cfg.norm_topk_prob else keep_probs
        if cfg.expert_bias:
            self.register_buffer("expert_bias_E", torch.zeros(cfg.num_experts, dtype=torch.float32))
            self.selection_scores = self._biased_selection
        else:
            self.expert_bias_E = None
            self.selection_scores = self.score_fn.selection

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = self.logits(x_TD)
        scores_TE = self.score_fn.scores(logits_TE)
        # The choice is not differentiable: detached, it builds no graph whose saved tensors
        # (top-k indices, group masks) memory.offload would copy to the host for nothing.
        idx_TK = self.select(self.selection_scores(logits_TE, scores_TE).detach())
        probs_TK = self.combine_weights(logits_TE, scores_TE, idx_TK)
        balance_TE = self.score_fn.balance(scores_TE)
        return Routing(probs_TK.float(), idx_TK, balance_TE.float(), logits_TE)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x_TD.device.type, enabled=False):
            x_TD = self.jitter(x_TD.to(self.router_dtype), self.training, self.token_places)
            return F.linear(x_TD, self.routing_weight().to(self.router_dtype))

    def routing_weight(self) -> torch.Tensor:
        """The [E, D] weight the logits read (under sequence parallelism its gradient is summed
        over the TP ranks, parallel/sequence.py)."""
        return self.weight

    def combine_weights(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor,
                        idx_TK: torch.Tensor) -> torch.Tensor:
        """The differentiable half of routing: the weights of the experts `idx_TK`, in router_dtype.

        The same for a live, replayed or round-robin selection, so gradients reach the router in
        every mode."""
        probs_TK = self.score_fn.chosen(logits_TE, scores_TE, idx_TK)
        return self.renormalize(probs_TK) * self.routed_scaling_factor

    def _biased_selection(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
        return self.score_fn.selection(logits_TE, scores_TE) + self.expert_bias_E

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Once per optimizer step: bias += rate · sign(mean load − load) (DeepSeek-V3, aux-loss-free
        balancing). `tokens_per_expert_E` is the step's (all-reduced) load. No-op without a bias."""
        if self.expert_bias_E is None:
            return
        # mean − load has the sign of Σ load − E·load, exact in int64. A float mean is off by a
        # fraction of a copy at DeepSeek-V3's ~2M copies per expert, and an expert within a copy of
        # it took no step or the wrong one.
        load_E = tokens_per_expert_E.long()
        under_mean_E = torch.sign(load_E.sum() - load_E.numel() * load_E)  # +1 under, -1 over
        self.expert_bias_E += self.expert_bias_update_rate * under_mean_E.to(self.expert_bias_E)


def build_router(dim: int, cfg: MoEConfig, replay: RouterReplay | None = None) -> Router:
    """The router of one MoE layer. Pass the model's one `RouterReplay` to every layer's call, in
    layer order: each router registers and takes the next layer index."""
    return Router(dim, cfg, replay)


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

