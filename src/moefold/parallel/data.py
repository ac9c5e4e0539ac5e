"""Data parallelism over the folded layout, and the gradient norm across both meshes.

Dense (non-expert) parameters are data-parallel over dp·cp, expert parameters over edp. Both kinds
must end up with the gradient of the same global loss, the mean of the dp·cp data ranks' losses:

- a dense gradient is complete on each rank for its data, so averaging over dp·cp gives it;
- an expert's gradient on one rank already sums the contributions of every token routed to it from
  the whole EP(×ETP) group, so the sum over edp covers every data rank once and must be divided by
  dp·cp, not by edp (else experts would learn ep·etp·... times too fast).

`parallel.data_parallel` picks the strategy once, when the model is parallelized; the trainer calls
it around the optimizer (`DataParallel`):

- `fsdp` (default): FSDP2 `fully_shard` of every block and of the root over the dp·cp mesh and of
  every MoE layer's experts over the edp mesh (gradient divide factor dp·cp; by their experts, or
  by dim 1 where a rank's experts do not split evenly over edp). Parameters, gradients and optimizer
  states are sharded; TP and EP weights (DTensors) get 2-D (FSDP × TP/EP) placements.
- `ddp`: ZeRO-1 (parallel/zero.py). Parameters replicated; after the step's last backward the
  gradients are reduce-scattered (dense over dp·cp, experts over edp), the optimizer updates and
  keeps states for this rank's shard only, and the updated shards are all-gathered back.

The global gradient norm sums each rank's squared local gradients, each divided by how many ranks
hold the same values (world / number of distinct shards), with one all-reduce over the world.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moefold.parallel.local import DeviceCopies, local_tensor


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for layer in model.moe_layers() for p in layer.experts.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


class DataParallel:
    """What the trainer calls around the optimizer step. This base has nothing left to do: one
    process, or FSDP2, which reduce-scatters gradients during backward and whose sharded parameters
    the optimizer updates in place. ZeRO-1 (parallel/zero.py) overrides every hook."""

    def __init__(self, optimized: nn.Module):
        self.optimized = optimized
        """The module whose parameters the optimizer updates, named as the model's: the model
        itself, or ZeRO-1's shards."""

    def optimizer_built(self) -> None:
        """Once, after the optimizer over `optimized` exists (it may have recast its parameters)."""

    def reduce_gradients(self) -> None:
        """After the step's last backward: average the gradients over the data ranks."""

    def gather_parameters(self) -> None:
        """After the optimizer step: bring the updated values into the parameters forward reads."""


def apply_data_parallel(model: nn.Module, layout, mode: str, grad_dtype: torch.dtype | None = None,
                        initialize=None) -> DataParallel:
    """Shard every parameter (fsdp) or its optimizer states (ddp: ZeRO-1) over its data-parallel
    mesh, on a model with TP/EP applied. `grad_dtype`: the dtype gradients are reduced in
    (default: the parameters'). `initialize(model)`, if given, materializes and fills a model on
    the meta device: after FSDP has sharded it, before ZeRO-1 views its (replicated) parameters.
    Returns the strategy the trainer calls."""
    initialize = initialize or (lambda model: None)
    if mode == "ddp":  # zero.py builds on this module: imported here
        from moefold.parallel.zero import Zero1DataParallel

        initialize(model)
        return Zero1DataParallel(model, layout, grad_dtype)
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    dims = layout.dims
    # reduce_dtype only: FSDP still gathers parameters in their own dtype, and casts the reduced
    # gradient back to it.
    fully_shard = functools.partial(fully_shard, mp_policy=MixedPrecisionPolicy(reduce_dtype=grad_dtype))
    for layer in model.moe_layers():
        fully_shard(layer.experts, mesh=layout.expert_dp_mesh,
                    shard_placement_fn=functools.partial(even_expert_shards, edp=dims.edp))
        layer.experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
        if dist.get_backend() == "gloo" and dims.edp > 1:
            # gloo has no pre-multiplied sum: sum, then divide. (Not with one rank, where FSDP
            # already divides while copying and would divide twice.)
            layer.experts.set_force_sum_reduction_for_comms(True)
    for block in model.blocks():
        fully_shard(block, mesh=layout.dense_dp_mesh)
    fully_shard(model, mesh=layout.dense_dp_mesh)
    # The MTP objective runs trunk() and then the head itself: trunk must gather the root's
    # parameters (embeddings, final norm, head) as forward does. The root keeps them gathered
    # until backward, so the head and the MTP modules can use them after trunk returns.
    register_fsdp_forward_method(model, "trunk")
    initialize(model)
    return DataParallel(model)


def even_expert_shards(p: nn.Parameter, edp: int) -> Shard:
    """FSDP's cut of an expert weight `[E, ...]` over the edp ranks: its experts (FSDP's default)
    when the rank's E/ep experts split evenly, else dim 1 (FSDP requires it to split evenly): 4
    local experts over 8 edp ranks would leave half the ranks one expert and half none, the
    fullest holding twice its share of the weights and their optimizer states."""
    local_shape = local_tensor(p).shape
    if local_shape[0] % edp == 0 or len(local_shape) < 2 or local_shape[1] % edp != 0:
        return Shard(0)
    return Shard(1)


# ---------------------------------------------------------------------------------------------
# Gradient norm and clipping across both meshes
# ---------------------------------------------------------------------------------------------


def replication(p: torch.Tensor, world: int) -> int:
    """How many ranks hold the same values as this rank's piece of `p`: world / distinct pieces.
    Pieces are distinct along the DTensor mesh dims `p` is sharded over (ZeRO-1's shards: their
    own TP/EP dims and the data-parallel one); plain tensors are replicated."""
    if not isinstance(p, DTensor):
        return world
    # Any non-replicated placement splits: Shard, and FSDP's _StridedShard over an EP-sharded dim
    # (which is not a Shard subclass).
    pieces = math.prod(p.device_mesh.size(i) for i, placement in enumerate(p.placements)
                       if not placement.is_replicate())
    return world // pieces


def scale_gradients(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Clip by multiplying every gradient in place (one foreach pass over all gradients)."""
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))


class GradNormClipper:
    """clip_grad_norm_ over parameters spread across the dense and expert meshes: one all-reduce of
    a scalar for the global norm, then every local gradient scaled by the same coefficient, by a
    strategy fixed at build (`scale_gradients`, or optim.adamw.ClipInFusedAdamW). No host sync."""

    def __init__(self, params: list[nn.Parameter], group=None, scale=scale_gradients):
        self.params, self.group, self.scale = params, group, scale
        world = dist.get_world_size(group) if group is not None else 1
        self.weights = [1.0 / replication(p, world) for p in params]
        self._device_weights = DeviceCopies()  # per set of present gradients

    @torch.no_grad()
    def __call__(self, max_norm: float) -> torch.Tensor:
        present = tuple(i for i, p in enumerate(self.params) if p.grad is not None)
        grads = [local_tensor(self.params[i].grad) for i in present]
        total_sq = self._local_sum_of_squares(grads, present)
        if self.group is not None:  # every rank enters it, one without gradients too (or the rest hang)
            dist.all_reduce(total_sq, group=self.group)
        norm = total_sq.sqrt()
        if grads and math.isfinite(max_norm):
            self.scale(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _local_sum_of_squares(self, grads: list[torch.Tensor], present: tuple[int, ...]) -> torch.Tensor:
        """This rank's share of the squared global norm: each piece's squared norm over its replicas."""
        if not grads:
            device = local_tensor(self.params[0]).device if self.params else torch.device("cpu")
            return torch.zeros((), dtype=torch.float32, device=device)
        # fp32 norms of bf16 gradients: rounded to bf16, each piece would be off by up to 2^-9
        norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        weights = self._device_weights.on(norms.device, present, lambda: [self.weights[i] for i in present])
        return (norms.square() * weights).sum()


__all__ = [
    "DataParallel",
    "GradNormClipper",
    "apply_data_parallel",
    "dense_parameters",
    "expert_parameters",
    "replication",
    "scale_gradients",
]
