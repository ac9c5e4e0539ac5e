"""`apply_fp8`: convert a built model's GEMMs to FP8, once, before it moves to its device and is
parallelized (see docs/fp8.md).

What runs in FP8: the nn.Linear projections inside the transformer blocks (attention q/k/v/o or
MLA's projections, dense MLPs, shared experts) and the routed experts' grouped GEMMs. What never
does: the router, the shared-expert gate, embeddings, the output head, norms, the attention core
(softmax(QK^T)V) and MTP's projection; nor the blocks in `fp8_bf16_first_layers` /
`fp8_bf16_last_layers`, modules matched by `fp8_exclude` (a module is excluded when its name or
a parent's name matches a pattern) and linears whose features on one TP rank (the shard
parallel.tp leaves it) are not multiples of the recipe's alignment (16, or 128 for blockwise),
which the FP8 kernels need. Routed experts whose features
are not aligned are refused (ConfigError) rather than silently left in bf16: they are most of an
MoE's GEMM time, and `fp8_exclude` keeps them in bf16 on purpose.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from moefold.config import PrecisionConfig
from moefold.errors import ConfigError
from moefold.fp8.gemm import build_gemm, linear_scaling
from moefold.fp8.grouped import build_grouped_gemm, grouped_scaling
from moefold.fp8.linear import Fp8Linear
from moefold.fp8.saved import SaveInput, saved_input
from moefold.fp8.weight_cache import build_weight_cache
from moefold.memory.sites import rewrap, tell_discarded_inputs, unwrapped
from moefold.moe.experts import Experts, Fp8GroupedExperts, expert_hidden_slice
from moefold.moe.layer import MoELayer
from moefold.parallel.tp_split import tp_local_features

_NEVER_FP8 = ("gate",)  # GatedSharedExperts.gate: a [D, 1] router-like scalar gate


def apply_fp8(model: nn.Module, precision: PrecisionConfig, device_type: str,
              shared_inputs: bool = True, compute_dtype: torch.dtype | None = None,
              sequence_parallel: bool = False, tp: int = 1, etp: int = 1) -> list[str]:
    """Swap the selected modules for their FP8 versions in place; returns their names.

    `model` is a Transformer (blocks(), layers). The FP8 modules share the original parameters, so
    weights, state dict and checkpoints are unchanged. precision.fp8='off' changes nothing.
    `shared_inputs`: the parameters will be in the compute dtype, so sibling linears (q/k/v, gate
    and up) read one input tensor instead of each casting its own copy (fp32 parameters under
    bf16 autocast); it decides which linears keep their input in FP8 (`_keeps_fp8_input`).
    `compute_dtype`: the run's (autocast below fp32), which decides what the experts cast their
    weights to and so what `precision.fp8_weight_cache` quantizes from (needed only with it; the
    cache is empty until refresh_weight_caches). `sequence_parallel`: the main blocks will run on
    sequence shards (parallel.sequence_parallel with tp > 1), where MLA's wq without q-LoRA
    all-gathers its own input (parallel/tensor.py) and shares it with no sibling. `tp` and `etp`:
    the ranks that will split the block linears (parallel.tp) and the experts' hidden features
    (parallel.etp): the FP8 GEMMs run on one rank's shard, so the alignment checked is the
    shard's.
    """
    if precision.fp8 == "off":
        return []
    lin, grouped = linear_scaling(precision.fp8), grouped_scaling(precision.fp8)
    gemm = build_gemm(device_type, precision.fp8_weight_grad, precision.fp8_emulate)
    grouped_gemm = build_grouped_gemm(device_type, precision.fp8_grouped_gemm, precision.fp8_weight_grad,
                                      precision.fp8, precision.fp8_emulate)
    weight_cache = build_weight_cache(precision.fp8_weight_cache, compute_dtype)
    keep = precision.fp8_saved_activations
    lin_saver, grouped_saver = saved_input(keep, lin.forward.a), saved_input(keep, grouped.forward.a)
    excluded = _excluded_names(model, precision)
    converted = []
    for block_name, block in _fp8_blocks(model, precision):
        mtp = block_name.startswith("mtp.")  # never sequence-parallel
        # An MTP block reads the projection's output, in the compute dtype: its inputs are shared.
        block_shares_inputs = shared_inputs or mtp
        siblings = _SEQUENCE_SHARD_SIBLINGS if sequence_parallel and not mtp else _SIBLINGS
        for name, module in list(block.named_modules(prefix=block_name)):
            if name in excluded:
                continue
            parent_name, _, attr = name.rpartition(".")
            if isinstance(module, Experts):
                _check_experts_aligned(module, precision.fp8, grouped.row_multiple, etp)
                layer = model.get_submodule(parent_name)
                _raise_pad_multiple(layer, grouped.row_multiple)  # only where the experts run FP8
                setattr(layer, attr, _fp8_experts(module, grouped_gemm, grouped, grouped_saver, weight_cache))
            elif type(module) is nn.Linear and attr not in _NEVER_FP8 and linear_aligned(
                    attr, module.in_features, module.out_features, tp, lin.row_multiple):
                parent = model.get_submodule(parent_name)
                saver = lin_saver if _keeps_fp8_input(parent, attr, block_shares_inputs, siblings) else SaveInput()
                as_is = _reads_parent_input(attr, block_shares_inputs, sequence_parallel and not mtp)
                setattr(parent, attr, Fp8Linear.from_linear(module, gemm, lin, saver,
                                                            discarded_input_saver=SaveInput() if as_is else saver))
            else:
                continue
            converted.append(name)
    tell_discarded_inputs(model)  # memory.recompute applied before (build_model's order)
    _refuse_idle_weight_cache(precision, model)
    return converted


def _refuse_idle_weight_cache(precision: PrecisionConfig, model: nn.Module) -> None:
    """The cache holds the FP8 routed experts' weights: with every expert in high precision (or
    none in the model) it would do nothing, and the run would train as without it, unsaid."""
    if precision.fp8_weight_cache and not any(isinstance(m, Fp8GroupedExperts) for m in model.modules()):
        raise ConfigError("precision.fp8_weight_cache=true does nothing here: no routed experts run in FP8 "
                          "(precision.fp8_exclude and fp8_bf16_first/last_layers keep them all in high "
                          "precision); set it to false")


def _fp8_blocks(model, precision: PrecisionConfig) -> list[tuple[str, nn.Module]]:
    """(name, block) of the blocks that may hold FP8 modules: not in the first/last N of the main
    stack. MTP blocks follow the main-stack rule for neither end: only fp8_exclude keeps them."""
    n = len(model.layers)
    first, last = precision.fp8_bf16_first_layers, precision.fp8_bf16_last_layers
    blocks = [(f"layers.{i}", b) for i, b in enumerate(model.layers) if first <= i < n - last]
    if getattr(model, "mtp", None) is not None:
        blocks += [(f"mtp.layers.{i}.block", m.block) for i, m in enumerate(model.mtp.layers)]
    return blocks


def excluded_by(patterns: list[str], name: str) -> bool:
    """Whether `precision.fp8_exclude` keeps module `name` in high precision: a pattern matches it
    or one of its parents (a module is excluded with any of its parents). The memory planner asks
    the same of the names it models."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern)
               for i in range(1, len(parts) + 1) for pattern in patterns)


def _excluded_names(model: nn.Module, precision: PrecisionConfig) -> set[str]:
    names = [name for name, _ in model.named_modules() if name]
    for pattern in precision.fp8_exclude:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"precision.fp8_exclude: pattern {pattern!r} matches no module name "
                              "(names look like 'layers.0.attn.wq', 'layers.1.ffn.experts')")
    return {n for n in names if excluded_by(precision.fp8_exclude, n)}


# Linears that read one tensor together: while any of them keeps it for backward, it is kept once.
_SIBLINGS = ({"wq", "wk", "wv"}, {"wq", "wkv_a"}, {"wq_a", "wkv_a"}, {"w1", "w3"})
# On a sequence shard MLA's wq without q-LoRA reads its own all-gathered x, wkv_a the rank's rows.
_SEQUENCE_SHARD_SIBLINGS = tuple(group for group in _SIBLINGS if group != {"wq", "wkv_a"})


def _keeps_fp8_input(parent: nn.Module, attr: str, shared_inputs: bool, siblings=_SIBLINGS) -> bool:
    """Whether precision.fp8_saved_activations should keep this linear's input in FP8: only where
    that frees the input's compute-dtype copy. Not for `wo`, whose input is a view of the attention
    core's output, which the core keeps for its own backward; not for siblings reading one shared
    tensor, which would each keep an FP8 copy (q, k, v: 3 bytes per element instead of 2). With
    fp32 parameters under autocast every sibling casts its own copy, and FP8 halves each."""
    if attr == "wo":
        return False
    has_sibling = any(attr in group and all(hasattr(parent, n) for n in group) for group in siblings)
    return not (has_sibling and shared_inputs)


# Linears that read their parent's input itself (a view of it, or a DTensor around it under TP):
# the first projections after a pre-norm. Under sequence parallelism GQA's, the MLPs' and MLA's
# wq without q-LoRA read an all-gathered copy; MLA's down-projections read the rank's rows.
_READ_PARENT_INPUT = frozenset({"wq", "wk", "wv", "wq_a", "wkv_a", "w1", "w3"})
_READ_PARENT_SHARD = frozenset({"wq_a", "wkv_a"})


def _reads_parent_input(attr: str, shared_inputs: bool, sequence_parallel: bool) -> bool:
    """Whether linear `attr` reads its parent's input itself: the tensor a recomputed pre-norm
    frees once the parent ran (memory.recompute 'norm'). Such a linear then keeps it as it is
    (Fp8Linear.memory_input_discarded): an FP8 copy (precision.fp8_saved_activations) would
    outlive the free. With fp32 parameters under autocast (`shared_inputs` false) each linear
    reads its own cast instead, which the free leaves, so its FP8 copy stays the cheaper."""
    return shared_inputs and attr in (_READ_PARENT_SHARD if sequence_parallel else _READ_PARENT_INPUT)


def linear_aligned(attr: str, in_features: int, out_features: int, tp: int, multiple: int) -> bool:
    """Whether the FP8 kernels can tile the shard one of `tp` ranks holds of the block linear
    `attr` (parallel/tp_split.py); the memory planner asks the same."""
    return all(features % multiple == 0 for features in tp_local_features(attr, in_features, out_features, tp))


def _check_experts_aligned(experts: Experts, recipe: str, multiple: int, etp: int = 1) -> None:
    """The grouped FP8 kernels tile the experts' features (each ETP rank's slice of the hidden
    ones): unlike an unaligned linear, which stays bf16, unaligned experts (most of an MoE's GEMM
    time) are refused with the way out."""
    _, dim, hidden = experts.w1_EDF.shape
    if dim % multiple or hidden % (multiple * etp):
        raise ConfigError(f"precision.fp8={recipe} needs model.dim ({dim}) and {expert_hidden_slice(hidden, etp)} "
                          f"to be multiples of {multiple} for the routed experts; keep them in bf16 with "
                          "precision.fp8_exclude=['*.experts'] or choose another recipe")


def _fp8_experts(experts: Experts, gemm, scaling, saver, weight_cache) -> Fp8GroupedExperts:
    """The FP8 experts in `experts`' place, with its parameters and its memory.recompute /
    memory.offload wrappers (`rewrap`: moe_act wraps the activation, and its recompute the down
    GEMM that keeps the activation's output, which the FP8 experts are told of when the wrap is
    carried over, as when memory.recompute wraps them after this: Fp8GroupedExperts.memory_site_wrapped)."""
    num_experts, dim, hidden = experts.w1_EDF.shape
    new = Fp8GroupedExperts(num_experts, dim, hidden, unwrapped(experts, "activation"), gemm, scaling, saver,
                            device="meta", weight_cache=weight_cache)
    for name, param in experts.named_parameters(recurse=False):
        setattr(new, name, param)
    rewrap(experts, new)
    return new


def _raise_pad_multiple(layer: MoELayer, multiple: int) -> None:
    """FP8 grouped kernels need every expert's row count to be a multiple of `multiple`: the
    permutation pads each group with zero rows (moe.pad_multiple, raised here, never lowered)."""
    layout = layer.dispatcher.layout
    layout.multiple = max(layout.multiple, multiple)
