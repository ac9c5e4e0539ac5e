"""Where each `memory.recompute` / `memory.offload` name lives in a built model.

A site is one callable attribute of one object: a module's `forward`, a method seam (`core`,
`up_proj`, `_mm`) or a strategy object (`experts.activation`). Wrapping replaces that attribute on
that instance only, so classes, parameter names and state dicts stay as they are, and transforms
applied later keep the wrapper as long as they change a wrapped object in place: tensor/expert
parallelism swap dispatchers and parameters, and turn the QK-norms into their head-sharded class
(parallel/tensor.py). A transform that puts a new module in a wrapped one's place carries the
wrappers over with `rewrap` (apply_fp8 does, for the routed experts); a plain swap would drop its
recompute or offload silently. An owner whose strategies depend on what is wrapped (`WrapAware`:
the FP8 experts) is told at each wrap, so the wrap may come before such a transform or after it;
so is a module inside a consumer whose input a recompute frees (`InputAware`: an FP8 linear that
reads a recomputed pre-norm's output).

A site may name its consumer: the callable that takes the site's output straight away and keeps it
for its own backward (the block's attention or FFN after a pre-norm, the attention core after MLA's
up-projection, the down-projection GEMM after the expert activation). Recompute then frees that
output once the consumer ran (recompute.DiscardedOutput).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn

from moefold.errors import ConfigError
from moefold.models.attention import Attention
from moefold.models.mla import MLAttention
from moefold.models.mlp import SwiGLUMLP
from moefold.models.norm import RMSNorm
from moefold.moe.layer import MoELayer


@dataclass(frozen=True)
class Site:
    owner: object
    name: str

    def wrap(self, make: Callable[[Callable], Callable]) -> None:
        """Replace the callable by `make(callable)`; a strategy object keeps its other attributes.
        The owner records the wrap (`unwrapped`, `rewrap`), and one that adapts to it is told
        (`WrapAware`)."""
        original = getattr(self.owner, self.name)
        wrapped = make(original)
        if not (inspect.ismethod(original) or inspect.isfunction(original)):
            wrapped = _CallableProxy(original, wrapped)
        setattr(self.owner, self.name, wrapped)
        vars(self.owner).setdefault(_WRAPS, []).append(_Wrap(self.name, make, original))
        if isinstance(self.owner, WrapAware):
            self.owner.memory_site_wrapped(self.name)

    def modules(self) -> list[nn.Module]:
        return list(self.owner.modules()) if isinstance(self.owner, nn.Module) and self.name == "forward" else []


@runtime_checkable
class WrapAware(Protocol):
    """An owner whose strategies depend on which of its callables are wrapped (the FP8 experts'
    down GEMM keeps its input as it is once its producer's output is discarded): told at each
    wrap, whether memory.recompute / memory.offload came before a transform that put the owner in
    place (`rewrap`) or after it (apply_recompute from Python after apply_fp8), so both orders
    build the same model."""

    def memory_site_wrapped(self, name: str) -> None: ...


@runtime_checkable
class InputAware(Protocol):
    """A module inside a consumer that may read the consumer's input itself (an FP8 linear after a
    pre-norm): told when memory.recompute frees that input once the consumer ran
    (`discard_input_of`), whether the module was put in place before the recompute was applied
    (apply_fp8 in the config's order, which then asks `tell_discarded_inputs`) or after it."""

    def memory_input_discarded(self) -> None: ...


_INPUT_DISCARDED = "_memory_input_discarded"  # set on a module whose forward's input is freed


def discard_input_of(consumer: Site) -> None:
    """Record that `consumer`'s input is freed once it ran (an output-discarding pair's consumer)
    and tell the InputAware modules inside it. Only a module's `forward` takes the module's input;
    a seam (MLA's `core`, the experts' `_mm`) takes a tensor the module made itself, which no
    module inside it reads as the module's input."""
    if consumer.name == "forward" and isinstance(consumer.owner, nn.Module):
        setattr(consumer.owner, _INPUT_DISCARDED, True)
        tell_discarded_inputs(consumer.owner)


def tell_discarded_inputs(model: nn.Module) -> None:
    """Tell every InputAware module inside a module whose input memory.recompute frees (a
    transform that puts such modules in place after the recompute was applied calls this)."""
    for module in model.modules():
        if vars(module).get(_INPUT_DISCARDED):
            for inner in module.modules():
                if isinstance(inner, InputAware):
                    inner.memory_input_discarded()


@dataclass(frozen=True)
class _Wrap:
    name: str
    make: Callable[[Callable], Callable]
    original: object  # the attribute before this wrap


_WRAPS = "_memory_wraps"  # an owner's _Wrap records, in the order they were applied


def is_wrapped(owner: object, name: str) -> bool:
    return any(w.name == name for w in vars(owner).get(_WRAPS, ()))


def unwrapped(owner: object, name: str):
    """`owner.<name>` as it was before memory.recompute / memory.offload wrapped it."""
    wraps = [w for w in vars(owner).get(_WRAPS, ()) if w.name == name]
    return wraps[0].original if wraps else getattr(owner, name)


def rewrap(old: nn.Module, new: nn.Module) -> None:
    """Wrap `new` as `old` was wrapped, in the same order, for a transform that puts `new` in
    `old`'s place (apply_fp8's experts), built from old's `unwrapped` attributes: the wrappers
    (a DiscardedOutput pair, an offload region) carry over, where a plain swap drops them."""
    for w in vars(old).get(_WRAPS, ()):
        Site(new, w.name).wrap(_rebound(w.make, old, new))
    if isinstance(vars(old).get("_memory_wrapped"), _Wrapped):
        new._memory_wrapped = _Wrapped()


def _rebound(make: Callable[[Callable], Callable], old: nn.Module, new: nn.Module) -> Callable[[Callable], Callable]:
    """`make` with its `owner` (apply_offload's: the module whose buffers its region leaves on the
    device) `new` where it was `old`: the region keeps the new module's buffers (the FP8 weight
    cache's), and nothing holds `old` and its parameters alive."""
    if isinstance(make, functools.partial) and make.keywords.get("owner") is old:
        return functools.partial(make.func, *make.args, **{**make.keywords, "owner": new})
    return make


@dataclass(frozen=True)
class Target:
    site: Site
    consumer: Site | None = None  # takes the site's output at once and saves it for backward
    unread: tuple[int, ...] = ()  # positional arguments the site ignores: a recompute holds none
    keeps_gemms: bool = False  # a checkpoint that keeps its GEMMs' outputs and recomputes the rest


class _CallableProxy:
    """A strategy object whose call is wrapped; its other attributes read through."""

    def __init__(self, inner, call: Callable):
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __deepcopy__(self, memo):
        refuse_deepcopy()


def refuse_deepcopy() -> None:
    raise TypeError("cannot deep-copy a model built with memory.recompute or memory.offload: its wrapped "
                    "forwards stay bound to the original (copy.deepcopy keeps functions as they are), so "
                    "the copy would run and train the original's weights; build the copy with build_model "
                    "and load_state_dict")


class _Wrapped:
    """Held by a module whose callables memory.recompute / memory.offload wrapped for good: the
    wrappers close over the original module, so a deep copy of it is refused (`refuse_deepcopy`)."""

    def __deepcopy__(self, memo):
        refuse_deepcopy()


def mark_wrapped(*sites: Site | None) -> None:
    """After wrapping `sites` for good: their modules refuse deep copies."""
    for site in sites:
        if site is not None and isinstance(site.owner, nn.Module):
            site.owner._memory_wrapped = _Wrapped()


def targets_of(model: nn.Module, key: str, names: Sequence[str], compiled: bool = False) -> list[Target]:
    """The sites of each of `names`, in order; a name without any in `model` is refused, as the
    config refuses it (`memory.<key>`): given in Python, it silently wrapped nothing. `compiled`:
    the blocks will be compiled (train.compile), which some names recompute otherwise."""
    chosen = []
    for name in names:
        found = targets(model, name, compiled)
        if not found:
            raise ConfigError(f"memory.{key}={name!r} does nothing here: the model has no {name} site "
                              "(memory/sites.py)")
        chosen += found
    return chosen


def targets(model: nn.Module, name: str, compiled: bool = False) -> list[Target]:
    """The sites of `name` (one of config.MEMORY_MODULES) in every block, MTP blocks included;
    `compiled`: those of compiled blocks (`_COMPILED_BLOCK_TARGETS`)."""
    table = _COMPILED_BLOCK_TARGETS if compiled else _BLOCK_TARGETS
    return [t for block in model.blocks() for t in table[name](block)]


def _norm(block) -> Iterator[Target]:
    yield Target(Site(block.attn_norm, "forward"), Site(block.attn, "forward"))
    yield Target(Site(block.ffn_norm, "forward"), Site(block.ffn, "forward"))
    if isinstance(block.attn, Attention):  # QK-norm; RoPE keeps nothing of its output
        for norm in (block.attn.q_norm, block.attn.k_norm):
            if isinstance(norm, RMSNorm):
                yield Target(Site(norm, "forward"))


def _attn_core(block) -> Iterator[Target]:
    yield Target(Site(block.attn, "core"))


def _mla_up_proj(block) -> Iterator[Target]:
    if isinstance(block.attn, MLAttention):
        yield Target(Site(block.attn, "up_proj"), Site(block.attn, "core"))


def _moe_act(block) -> Iterator[Target]:
    if isinstance(block.ffn, MoELayer):
        experts = block.ffn.experts
        # Without the memory-efficient permutation the activation is handed the [R] probabilities
        # (its first argument) and ignores them: the combine weighs the rows.
        unread = () if experts.activation.applies_probs else (0,)
        yield Target(Site(experts, "activation"), Site(experts, "_mm"), unread)


def _moe_act_checkpointed(block) -> Iterator[Target]:
    """moe_act in a compiled block: one checkpoint over the activation and the down GEMM that keeps
    the GEMM's output and recomputes the activation, so the activation's output is never kept
    and the GEMM never runs twice. Dynamo traces it into the block's graph, where `_moe_act`'s
    output discarding (storage resizing, RNG capture) breaks the graph around both."""
    if isinstance(block.ffn, MoELayer):
        yield Target(Site(block.ffn.experts, "_down"), keeps_gemms=True)


def _shared_experts(block) -> Iterator[Target]:
    if isinstance(block.ffn, MoELayer) and block.ffn.shared is not None:
        yield Target(Site(block.ffn.shared, "forward"))


def _mlp(block) -> Iterator[Target]:
    if isinstance(block.ffn, SwiGLUMLP):
        yield Target(Site(block.ffn, "forward"))


def _moe(block) -> Iterator[Target]:
    if isinstance(block.ffn, MoELayer):
        yield Target(Site(block.ffn, "forward"))


def _layer(block) -> Iterator[Target]:
    yield Target(Site(block, "forward"))


_BLOCK_TARGETS = {"norm": _norm, "attn_core": _attn_core, "mla_up_proj": _mla_up_proj,
                  "moe_act": _moe_act, "shared_experts": _shared_experts, "mlp": _mlp, "moe": _moe,
                  "layer": _layer}
_COMPILED_BLOCK_TARGETS = {**_BLOCK_TARGETS, "moe_act": _moe_act_checkpointed}
