"""`parallelize`: turn a built single-process model into its folded-parallel form on this rank.

Every rank builds the same full model (on the meta device in a run; a filled one also works),
then calls `parallelize`, which keeps this rank's share: attention and dense MLPs (and shared
experts) TP-sharded over the attention grid's tp, routed experts EP/ETP-sharded over the expert
grid, each MoE layer dispatching only its TP rank's tokens (under sequence parallelism the shard
it routes) and counting routed copies over the data ranks, and finally every parameter FSDP-sharded (or replicated) over its data-parallel mesh.
A model on the meta device is materialized and initialised only then, each rank allocating and
filling its own pieces (`Trainer._build_model`): no rank holds, draws or reads much more of the
model than its shards.
"""

from collections.abc import Callable

import torch
from torch import nn

from moefold.config import ParallelConfig
from moefold.moe.balance import DataParallelCounts
from moefold.parallel.data import apply_data_parallel
from moefold.parallel.dims import ParallelLayout
from moefold.parallel.expert import apply_expert_parallel
from moefold.parallel.sequence import split_sequence_over_tp
from moefold.parallel.tensor import apply_tp


def parallelize(model: nn.Module, layout: ParallelLayout, cfg: ParallelConfig,
                grad_dtype: torch.dtype | None = None,
                initialize: Callable[[nn.Module], None] | None = None):
    """Apply TP, EP/ETP and data parallelism in place; returns the gradient-sync strategy the
    trainer calls after each step's last backward (parallel/data.py). `grad_dtype`: the dtype
    gradients are reduced in over the data ranks (optim.grad_dtype; None keeps the parameters').
    `initialize(model)` materializes and fills a model built on the meta device once it holds
    only this rank's shards (None: the model is already filled)."""
    dims = layout.dims
    apply_tp(model, layout.tp_mesh, cfg.sequence_parallel)
    for layer in model.moe_layers():
        apply_expert_parallel(layer, layout, cfg.ep_dispatcher)
        split_sequence_over_tp(layer, layout.tp_group)
        layer.router.token_places.data_rank = layout.attention_coords[1]  # the rows the trainer gives it
        if dims.dp * dims.cp > 1:  # on top of the sum over a sequence-parallel layer's shards
            layer.count_routed = DataParallelCounts(layout.dp_cp_group, layer.count_routed.sum_over_shards)
    return apply_data_parallel(model, layout, cfg.data_parallel, grad_dtype, initialize)
