"""Fine-grained activation recompute: `apply_recompute(model, names)` (memory.recompute).

Two ways to recompute, chosen per site (memory/sites.py) when the model is built:

* `checkpointed`: torch.utils.checkpoint, non-reentrant. The site keeps only its inputs; backward
  runs it again (same RNG state, same autocast) to rebuild what its ops saved. A region holding MoE
  layers (`moe`, `layer`) replays their forward's routing and records nothing (moe_tape.py).
  `moe_act` in blocks that train.compile compiles is one too, over the activation and the down GEMM,
  with a selective policy that keeps the GEMM's output (`keep_gemm_outputs`): Dynamo traces it into
  the block's graph, where the output discarding below breaks it (memory/sites.py).
* `DiscardedOutput`: Megatron-Core's CheckpointWithoutOutput, for a site whose output its consumer
  takes at once and keeps for backward (the attention after a pre-norm keeps the normed x; the
  attention core keeps MLA's per-head q/k/v; the down-projection keeps the expert activation). The
  site runs without a graph and keeps its inputs; once the consumer ran, the output's storage is
  freed (`untyped_storage().resize_(0)`, which the consumer's saved reference shares), and a hook
  on the consumer's output rebuilds it in place right before the consumer's backward. The site's own
  backward then differentiates that one recompute: nothing runs twice. When the consumer is not the
  output's only user as expected (another call in between, a copy instead of the tensor or a view
  of it), the output is simply not freed, which costs memory but never correctness.

Neither way changes a result: recomputed ops see the same inputs, RNG state and autocast state, so
losses and gradients are bit-identical to the plain run (tests/unit/test_recompute.py).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    get_device_states, set_device_states)

from moefold.config import refuse_offload_against, refuse_recomputed_twice, validate_memory_names
from moefold.memory.moe_tape import moe_recompute_contexts
from moefold.memory.sites import Site, discard_input_of, mark_wrapped, targets_of
from moefold.moe.layer import MoELayer
from moefold.parallel.local import memory_holder


def apply_recompute(model: torch.nn.Module, names: Sequence[str], compiled: bool = False) -> None:
    """Wrap the sites of `names` (config.MEMORY_MODULES): whole regions first, then the
    output-discarding pairs, so a consumer that is itself checkpointed frees its input too.
    `compiled`: the blocks will be compiled (train.compile), so moe_act is a checkpoint that
    Dynamo traces instead of an output discarding (memory/sites.py)."""
    validate_memory_names("recompute", names)  # given in Python: no config check saw them
    recomputed = [*getattr(model, "recomputed_names", []), *names]  # with a call's before (build_model's)
    validate_memory_names("recompute", recomputed)
    refuse_recomputed_twice(recomputed)
    # A name the model offloads already (apply_offload's): the config's check, in its words. Only
    # the overlap is checked here: apply_offload checked its min_bytes.
    refuse_offload_against(recomputed, getattr(model, "offloaded_names", []), min_bytes=0)
    chosen = targets_of(model, "recompute", names, compiled)
    model.recomputed_names = recomputed
    for target in (t for t in chosen if t.consumer is None):
        moe_layers = [m for m in target.site.modules() if isinstance(m, MoELayer)]
        target.site.wrap(lambda fn, layers=moe_layers, keeps_gemms=target.keeps_gemms:
                         checkpointed(fn, layers, keeps_gemms))
    for target in (t for t in chosen if t.consumer is not None):
        DiscardedOutput(target.site, target.consumer, target.unread)
    for target in chosen:
        mark_wrapped(target.site, target.consumer)


def checkpointed(fn: Callable, moe_layers: list[MoELayer], keeps_gemms: bool = False) -> Callable:
    """`fn` under a non-reentrant checkpoint; `keeps_gemms`: one that keeps the outputs of its
    GEMMs (`keep_gemm_outputs`) and recomputes only the rest."""
    # None without MoE layers: under torch.compile a context_fn must give TorchDispatchModes (a
    # pair of nullcontexts failed the compile of a recomputed norm, attention core or dense block).
    contexts = {"context_fn": lambda: moe_recompute_contexts(moe_layers)} if moe_layers else {}
    if keeps_gemms:
        contexts = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_gemm_outputs)}

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **contexts, **kwargs)
    return run


# The GEMMs a `keeps_gemms` checkpoint keeps: the expert GEMMs in every backend (the FP8 emulation
# runs torch._grouped_mm, CUTLASS torch._scaled_grouped_mm, Triton its custom ops) and the loop's.
_GEMMS = frozenset({"aten::mm", "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_grouped_mm",
                    "moefold::fp8_grouped_mm_rows", "moefold::fp8_grouped_mm_rows_blockwise",
                    "moefold::scaled_mm_blockwise"})


def keep_gemm_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpoint policy: a GEMM's output is kept from the forward, the rest (the
    elementwise activation, the FP8 quantization) recomputed."""
    name = op.name() if isinstance(op, torch._ops.OpOverload) else None
    return CheckpointPolicy.MUST_SAVE if name in _GEMMS else CheckpointPolicy.PREFER_RECOMPUTE


class DiscardedOutput:
    """One producer → consumer pair: the producer's output is freed after the consumer ran and
    rebuilt just before the consumer's backward (see the module docstring)."""

    def __init__(self, producer: Site, consumer: Site, unread: tuple[int, ...] = ()):
        self._pending: _Run | None = None  # set by the producer, taken by the very next consumer call
        self._unread = unread  # the producer's arguments it ignores: neither held nor recomputed with
        producer.wrap(self._producing)
        consumer.wrap(self._consuming)
        discard_input_of(consumer)  # an FP8 linear reading the freed output keeps it as it is

    def _producing(self, fn: Callable) -> Callable:
        def produce(*args):
            if not torch.is_grad_enabled():
                return fn(*args)
            self._pending = _Run(fn, args, self._unread)
            return self._pending.forward(args)
        return produce

    def _consuming(self, fn: Callable) -> Callable:
        def consume(*args, **kwargs):
            run, self._pending = self._pending, None
            out = fn(*args, **kwargs)
            if run is not None and run.consumed_by(args) and out.requires_grad:
                run.discard_until_backward_of(out)
            return out
        return consume


class _Holder:
    """Stands in for one tensor the producer saved; the recompute's tensor is found by it."""
    __slots__ = ("__weakref__",)


class _Run:
    """One call of a producer, run like a non-reentrant checkpoint: the forward builds the real
    graph (so backward sums gradients in the same order as the plain run, bit for bit) but each
    tensor it saves is replaced by a `_Holder`; the one recompute fills them and rebuilds the
    output. A recomputed tensor is freed with its holder, when autograd releases the node. `args`
    holds the inputs until the recompute, None for the `unread` ones (the producer ignores them)."""

    def __init__(self, fn: Callable, args: tuple, unread: tuple[int, ...] = ()):
        self.fn, self.outputs, self.freed = fn, (), {}
        self.args = tuple(None if i in unread else a for i, a in enumerate(args))
        # Autograd refuses a saved tensor changed in place since; the inputs kept for the recompute
        # are checked as it would check them, or the recompute would silently use the new values.
        self.versions = tuple(memory_holder(a)._version if isinstance(a, torch.Tensor) else None
                              for a in self.args)
        self.holders: list[weakref.ref[_Holder]] = []
        self.recomputed: weakref.WeakKeyDictionary[_Holder, torch.Tensor] = weakref.WeakKeyDictionary()
        self.device_type = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        self.rng_cpu = torch.get_rng_state()
        self.rng_devices = get_device_states(*args)
        self.autocast = {dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                         for dt in {"cpu", self.device_type}}

    def forward(self, args: tuple):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            outputs = self.fn(*args)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def _pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        return holder

    def _unpack(self, holder: _Holder) -> torch.Tensor:
        if self.args is not None:  # the output was never freed: recompute on first use
            self.recompute()
        return self.recomputed[holder]

    def consumed_by(self, args: tuple) -> bool:
        """The consumer got every output's memory (the output itself or a view of it, not a copy:
        an MoE layer under sequence parallelism gets the local shard of the normed DTensor, which
        its input hook takes out), and no output shares an input's storage (freeing it would free
        the input)."""
        inputs = {_storage(a).data_ptr() for a in self.args if isinstance(a, torch.Tensor)}
        given = {_storage(a).data_ptr() for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        return all(o.device.type != "meta" and _storage(o).data_ptr() in given - inputs for o in self.outputs)

    def discard_until_backward_of(self, consumer_out: torch.Tensor) -> None:
        for o in self.outputs:
            self.freed.setdefault(_storage(o).data_ptr(), (o, _storage(o).nbytes()))
        for o, _ in self.freed.values():
            _storage(o).resize_(0)
        consumer_out.register_hook(self._restore)

    def _restore(self, grad: torch.Tensor) -> None:
        if not self.freed:  # a retained graph's next backward: the first refilled it, and the
            return  # recompute's tensors live as long as the holders the graph keeps
        recomputed_of = {id(o): new for o, new in zip(self.outputs, self.recompute())}
        for o, nbytes in self.freed.values():
            storage = _storage(o)
            storage.resize_(nbytes)
            storage.copy_(_storage(recomputed_of[id(o)]))
        self.outputs, self.freed = (), {}

    def recompute(self) -> tuple[torch.Tensor, ...]:
        args, self.args = self.args, None  # the inputs are kept only until now
        for i, (a, version) in enumerate(zip(args, self.versions)):
            if version is not None and memory_holder(a)._version != version:
                raise RuntimeError(f"input {i} of the recomputed {getattr(self.fn, '__qualname__', self.fn)} "
                                   f"was modified by an inplace operation after its forward (version "
                                   f"{version}, now {memory_holder(a)._version}): the recompute would "
                                   "use the new values")
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in args]
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t.detach())
        with torch.random.fork_rng(devices=self.rng_devices[0], device_type=self.device_type), \
                torch.enable_grad(), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.rng_cpu)
            set_device_states(*self.rng_devices, device_type=self.device_type)
            for dt, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None))
            outputs = self.fn(*inputs)
        if len(saved) != len(self.holders):
            raise RuntimeError(f"recompute of {self.fn} saved {len(saved)} tensors, its forward "
                               f"{len(self.holders)}: the producer is not deterministic")
        for ref, t in zip(self.holders, saved):
            holder = ref()
            if holder is not None:
                self.recomputed[holder] = t
        return tuple(o.detach() for o in (outputs if isinstance(outputs, tuple) else (outputs,)))


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The memory `t` holds on this rank (a sequence-parallel norm's input and output are
    DTensors)."""
    return memory_holder(t).untyped_storage()
