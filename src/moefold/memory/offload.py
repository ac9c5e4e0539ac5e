"""Activation offload: `apply_offload(model, names, min_bytes, device_type)` (memory.offload).

Each call of a named site (memory/sites.py) runs under `torch.autograd.graph.saved_tensors_hooks`:
pack copies a saved tensor to host memory and keeps only that copy, unpack brings it back when
backward needs it. The copy keeps the tensor's exact strides and values, so results are
bit-identical to the plain run. Parameters (and their dtype casts, e.g. a bf16 copy of an expert
weight) stay on the device: they outlive the step anyway. So do tensors under `min_bytes`, where a
copy's launch costs more than the memory is worth, and broadcast views (stride 0, small by nature).

Under tensor parallelism many saved tensors are DTensors: the sharded linears' inputs and, with
sequence parallelism, everything the pre-norms save. A DTensor is a wrapper; its local shard holds
the memory, so the shard is what moves (`min_bytes` and the stride check apply to it), with its
place in the whole (mesh, placements, global shape and stride). Unpack wraps the shard brought back
in an equal DTensor (`DTensor.from_local`, no communication), detached as a non-reentrant
checkpoint's recomputed tensors are: backward reads only the value.

The copier is a strategy chosen from the device type when the model is built:
* `StreamedHostCopy` (CUDA): device→host copies go to pinned memory on a side stream during forward
  (the source is `record_stream`ed, so its memory is not reused before the copy ends). One site
  call's tensors form a group; the first unpack of a group brings the whole group back on the side
  stream and starts bringing the group saved before it, which backward needs next.
* `HostCopy` (CPU, or where nothing overlaps): a plain synchronous copy to a host tensor (pinned
  when CUDA is available). On a CPU-only machine it saves nothing, but it runs the same hooks, so
  the CPU tests prove the path and its bit-identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from moefold.memory.sites import targets
from moefold.parallel.local import memory_holder


def apply_offload(model: torch.nn.Module, names: Sequence[str], min_bytes: int,
                  device_type: str) -> ActivationOffload | None:
    """Wrap the sites of `names`; returns the offload (None when nothing is offloaded)."""
    if not names:
        return None
    offload = ActivationOffload(min_bytes, StreamedHostCopy() if device_type == "cuda" else HostCopy())
    for name in names:
        for target in targets(model, name):
            target.site.wrap(offload.wrap)
    return offload


class ActivationOffload:
    def __init__(self, min_bytes: int, copier: HostCopy | StreamedHostCopy):
        self.min_bytes, self.copier = min_bytes, copier
        self.offloaded_bytes = 0  # since the model was built: a diagnostic

    def wrap(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            self.copier.begin_group()
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return fn(*args, **kwargs)
        return run

    def pack(self, t: torch.Tensor):
        local = memory_holder(t)
        if not self._offloadable(t, local):
            return t
        self.offloaded_bytes += local.numel() * local.element_size()
        host = self.copier.to_host(local)
        return host if local is t else _OffloadedShard(host, t)

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _OffloadedShard):
            return packed.rebuild(self.copier.to_device(packed.local))
        return self.copier.to_device(packed)

    def _offloadable(self, t: torch.Tensor, local: torch.Tensor) -> bool:
        # type() is not isinstance(): parameters, DTensors and fake tensors are subclasses. A
        # DTensor parameter is a DTensor: _is_weight looks at the wrapper, the rest at its shard.
        return (type(local) is torch.Tensor and local.layout == torch.strided
                and local.device.type != "meta" and self.copier.accepts(local)
                and local.numel() * local.element_size() >= self.min_bytes and not _is_weight(t)
                and all(stride or size == 1 for size, stride in zip(local.shape, local.stride())))


# What a parameter goes through on its way to an op that saves it, the result still counting as
# the parameter (on the device for the whole step anyway): a dtype cast, and a DTensor parameter's
# `to_local()` (the experts read their EP/ETP-sharded weights so, parallel/expert.py).
_WEIGHT_STEPS = ("ToCopyBackward0", "_ToTorchTensorBackward")


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter-like leaf, a view of one (an expert's slice `w_EXY[e]`), or a dtype cast or
    DTensor shard (`to_local()`) of one, or a view of those."""
    base = t._base if t._base is not None else t
    if base.is_leaf and base.requires_grad:
        return True
    fn = base.grad_fn
    if base.is_leaf:  # t views a leaf autograd does not see: a DTensor's shard, through to_local()
        fn = t.grad_fn
        while fn is not None and type(fn).__name__ not in _WEIGHT_STEPS and len(fn.next_functions) == 1:
            fn = fn.next_functions[0][0]  # t's own view ops, back to the to_local()
    if fn is None or type(fn).__name__ not in _WEIGHT_STEPS:
        return False
    while type(fn).__name__ in _WEIGHT_STEPS:
        fn = fn.next_functions[0][0]
    return hasattr(fn, "variable")  # AccumulateGrad: a parameter's


def _empty_strided_like(t: torch.Tensor, device, pin_memory: bool = False) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin_memory)


class _OffloadedShard:
    """A DTensor's local shard gone to the host (`local`, as the copier packed it), and where it
    sits in the whole: unpack rebuilds an equal DTensor around the shard brought back. Not the
    DTensor itself, which would keep the shard's device memory alive."""
    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local, t: DTensor):
        self.local, self.mesh, self.placements = local, t.device_mesh, t.placements
        self.shape, self.stride = t.shape, t.stride()

    def rebuild(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


class _Offloaded:
    """A saved tensor's host copy, and what it takes to bring it back."""
    __slots__ = ("__weakref__", "copied", "device", "group", "host", "prefetched")

    def __init__(self, host: torch.Tensor, device: torch.device, copied=None, group=None):
        self.host, self.device, self.copied, self.group, self.prefetched = host, device, copied, group, None


class HostCopy:
    """Synchronous copies; a CPU tensor comes back as its host copy."""

    def __init__(self):
        self.pin_memory = torch.cuda.is_available()

    def begin_group(self) -> None:
        pass

    def accepts(self, t: torch.Tensor) -> bool:
        return True

    def to_host(self, t: torch.Tensor) -> _Offloaded:
        host = _empty_strided_like(t, "cpu", self.pin_memory and t.device.type != "cpu")
        host.copy_(t)
        return _Offloaded(host, t.device)

    def to_device(self, packed: _Offloaded) -> torch.Tensor:
        if packed.device.type == "cpu":
            return packed.host
        return _empty_strided_like(packed.host, packed.device).copy_(packed.host)


class _Group:
    """The tensors one site call saved, and the group saved before it (weakly)."""

    def __init__(self, previous: _Group | None):
        self.previous = weakref.ref(previous) if previous is not None else None
        self.members: list[weakref.ref[_Offloaded]] = []
        self.fetched = None  # event on the side stream once the whole group is back on the device


class StreamedHostCopy:
    """CUDA: pinned host memory, copies both ways on a side stream per device."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._group = _Group(None)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def begin_group(self) -> None:
        self._group = _Group(self._group)

    def accepts(self, t: torch.Tensor) -> bool:
        """Only device tensors: attention kernels also save small host tensors (RNG state)."""
        return t.is_cuda

    def to_host(self, t: torch.Tensor) -> _Offloaded:
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
        with torch.cuda.stream(stream):
            host = _empty_strided_like(t, "cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # t's memory is not reused before the copy ends
        packed = _Offloaded(host, t.device, stream.record_event(), self._group)
        self._group.members.append(weakref.ref(packed))
        return packed

    def to_device(self, packed: _Offloaded) -> torch.Tensor:
        group = packed.group
        self._fetch(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None:
            self._fetch(previous)  # backward needs it next: its copies overlap this group's compute
        current = torch.cuda.current_stream(packed.device)
        t, packed.prefetched = packed.prefetched, None
        if t is None:  # unpacked a second time: copy again on the compute stream
            current.wait_event(packed.copied)
            return _empty_strided_like(packed.host, packed.device).copy_(packed.host, non_blocking=True)
        current.wait_event(group.fetched)
        t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return t

    def _fetch(self, group: _Group) -> None:
        if group.fetched is not None:
            return
        alive = [p for p in (ref() for ref in group.members) if p is not None]
        if not alive:
            return
        stream = self._stream(alive[0].device)
        with torch.cuda.stream(stream):  # after the device→host copies on the same stream
            for p in alive:
                p.prefetched = _empty_strided_like(p.host, p.device).copy_(p.host, non_blocking=True)
        group.fetched = stream.record_event()
