"""Activation offload: `apply_offload(model, names, min_bytes, device_type)` (memory.offload).

Each call of a named site (memory/sites.py) is a region run under
`torch.autograd.graph.saved_tensors_hooks`: pack copies the storage of a saved tensor to host memory
and keeps only that copy, unpack brings it back when backward needs it. The unit is the storage, not
the tensor: the tensors one region saves are often views of one storage (a linear's input saved by
the gate and the up projection, the halves of a fused output), so each storage is copied once per
region and every tensor saved on it comes back as a view of one restored storage, with its own
shape, strides, offset and dtype. Results are bit-identical to the plain run. A storage changed in
place after a tensor on it was saved (its version counter moved) is copied again for the later
tensors, since each must come back with the values it had when saved. The region's table of copies
lives for its forward only; a restored storage is held for the tensors on it until each of them was
unpacked, then autograd's references alone keep it.

Parameters (and their dtype casts, e.g. a bf16 copy of an expert weight) stay on the device: they
outlive the step anyway, as do the site's module buffers (precision.fp8_weight_cache's FP8 expert
weights, which the experts' GEMMs save for backward). So do tensors on a storage under `min_bytes`,
where a copy's launch costs more than the memory is worth (the storage, what moves, is measured:
small views of a large one go, all with one copy), and broadcast views (stride 0, small by nature).

Under tensor parallelism many saved tensors are DTensors: the sharded linears' inputs and, with
sequence parallelism, everything the pre-norms save. A DTensor is a wrapper; its local shard holds
the memory, so the shard's storage is what moves (`min_bytes` and the stride check apply to the
shard), with the shard's place in the whole (its DTensorSpec: mesh, placements, shard order, global
shape and stride). Unpack wraps the shard brought back in an equal DTensor (no communication),
detached as a non-reentrant checkpoint's recomputed tensors are: backward reads only the value.

The copier is a strategy chosen from the device type when the model is built; it moves one storage's
bytes (`storage_B`: B bytes, a flat uint8 tensor over the whole storage) each way:
* `StreamedHostCopy` (CUDA): device→host copies go to pinned memory on a side stream during forward
  (the source is `record_stream`ed, so its memory is not reused before the copy ends). One region's
  storages form a group; the first unpack of a group brings the whole group back on the side stream
  and starts bringing the group saved before it, which backward needs next.
* `HostCopy` (CPU, or where nothing overlaps): a plain synchronous copy to a host tensor (pinned
  when CUDA is available). On a CPU-only machine it saves nothing, but it runs the same hooks, so
  the CPU tests prove the path and its bit-identity.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from moefold.config import refuse_offload_against, validate_memory_names
from moefold.memory.sites import mark_wrapped, targets_of
from moefold.moe.recomputing import in_backward
from moefold.parallel.local import memory_holder


def apply_offload(model: torch.nn.Module, names: Sequence[str], min_bytes: int,
                  device_type: str) -> ActivationOffload | None:
    """Wrap the sites of `names`; returns the offload (None when nothing is offloaded)."""
    validate_memory_names("offload", names)  # names given in Python: no config check saw them
    refuse_offload_against(getattr(model, "recomputed_names", []), names, min_bytes)
    model.offloaded_names = [*getattr(model, "offloaded_names", []), *names]  # apply_recompute's check
    if not names:
        return None
    on_cuda = torch.device(device_type).type == "cuda"  # "cuda:1" too
    offload = ActivationOffload(min_bytes, StreamedHostCopy() if on_cuda else HostCopy())
    for target in targets_of(model, "offload", names):
        target.site.wrap(functools.partial(offload.wrap, owner=target.site.owner))
        mark_wrapped(target.site)
    return offload


class ActivationOffload:
    """The offload of one model: its sites' regions, the host copies, the count of what moved."""

    offloaded_bytes: int
    """Bytes moved to the host and brought back for backward since the model was built: each host
    copy (one per storage and region call) once, when backward first restores it. Per micro-batch
    that is the host memory the copies hold when forward ends (MemoryPlan.offloaded), and the most
    they hold: a recomputed region's offloaded sites copy nothing when backward runs them again
    (`_recomputed`). Copies never brought back do not count: those of tensors saved by graph nodes
    that die in forward (whose output nothing differentiates)."""

    def __init__(self, min_bytes: int, copier: HostCopy | StreamedHostCopy):
        self.min_bytes, self.copier = min_bytes, copier
        self.offloaded_bytes = 0
        # Per open region (nested sites nest), its storages' host copies by (storage, version).
        self._regions: list[dict[tuple[StorageWeakRef, int], _Offloaded]] = []
        self._buffers: set[int] = set()  # the open regions' module buffers' storages (_cdata)

    def wrap(self, fn: Callable, owner: object = None) -> Callable:
        """`owner`: the site's module, whose buffers stay on the device."""
        def run(*args, **kwargs):
            with self._keeping_buffers(owner), self.region():
                return fn(*args, **kwargs)
        return run

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Offload what autograd saves inside: each storage goes to the host once."""
        self.copier.begin_group()
        self._regions.append({})
        try:  # self.pack looked up per call: plan.measure and tests replace it
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._regions.pop()  # the tensors packed hold their copies; nothing else may

    @contextlib.contextmanager
    def _keeping_buffers(self, owner: object) -> Iterator[None]:
        """`owner`'s buffers stay: they outlive the step, as parameters do (precision.fp8_weight_cache's
        FP8 expert weights, which their GEMMs save for backward). Read at each call: apply_fp8 puts
        new experts in place after the wrapping, and each cache refresh registers new buffers."""
        buffers = owner.buffers() if isinstance(owner, torch.nn.Module) else ()
        outer, self._buffers = self._buffers, self._buffers | {b.untyped_storage()._cdata for b in buffers}
        try:
            yield
        finally:
            self._buffers = outer

    def pack(self, t: torch.Tensor):
        if in_backward():  # a checkpoint's recompute: see _recomputed
            return _recomputed(t)
        local = memory_holder(t)
        if not self._offloadable(t, local):
            return t
        return _Saved(self._host_copy(local), local, _Place(t) if local is not t else None)

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.view_in(self._restored(packed))

    def _host_copy(self, local: torch.Tensor) -> _Offloaded:
        """The region's host copy of `local`'s storage as it is now: a tensor saved on a storage
        written in place since the last copy (autograd bumped its version) needs its own."""
        storage = local.untyped_storage()
        copies = self._regions[-1] if self._regions else {}  # outside a region: no sharing
        key = (StorageWeakRef(storage), local._version)  # weak: the device memory may go
        if key not in copies:
            copies[key] = self.copier.to_host(_bytes_of(storage))
        copies[key].sharers += 1
        return copies[key]

    def _restored(self, saved: _Saved) -> torch.Tensor:
        """`saved`'s storage back on its device: one restore for all the tensors saved on it."""
        copy = saved.copy
        if copy.restored_B is None:
            copy.restored_B = self.copier.to_device(copy)
            if not copy.returned:  # (a retained graph's next backward restores it again)
                copy.returned = True
                self.offloaded_bytes += copy.host_B.nbytes
        restored_B = copy.restored_B
        copy.unpacked.add(id(saved))
        if len(copy.unpacked) == copy.sharers:  # all have their views: autograd holds it from here
            copy.restored_B, copy.unpacked = None, set()  # (a retained graph's next backward: anew)
        return restored_B

    def _offloadable(self, t: torch.Tensor, local: torch.Tensor) -> bool:
        # type() is not isinstance(): parameters, DTensors and fake tensors are subclasses. A
        # DTensor parameter is a DTensor: _is_weight looks at the wrapper, the rest at its shard.
        # A conjugate or negative view's bit would not survive a storage copy (no model here is
        # complex, so none is saved).
        return (type(local) is torch.Tensor and local.layout == torch.strided
                and local.device.type != "meta" and self.copier.accepts(local)
                and not local.is_conj() and not local.is_neg()
                and local.untyped_storage().nbytes() >= self.min_bytes and not _is_weight(t)
                and local.untyped_storage()._cdata not in self._buffers
                and all(stride or size == 1 for size, stride in zip(local.shape, local.stride())))


def _recomputed(t: torch.Tensor) -> torch.Tensor:
    """What a site saves when a checkpoint around it (a recomputed `layer` or `moe`) runs it again
    in backward: the tensor, detached. The forward graph's nodes hold the site's host copies, and
    torch.utils.checkpoint (non-reentrant) takes only what its own hooks saved from the recompute,
    whose graph is never differentiated and dies when the recompute ends: a second host copy would
    be traffic and pinned memory for nothing (tiny-deepseek, fp32, micro-batch 2, `layer`
    recomputed with `attn_core` offloaded: 1,589,248 B copied again in each backward). Detached,
    since the tensor itself would close a cycle no backward breaks when an op saves its own
    output (the output, its grad_fn, the saved output): the recomputed graph would never be freed."""
    return t.detach()


# What a parameter goes through on its way to an op that saves it, the result still counting as
# the parameter (on the device for the whole step anyway): a dtype cast, a DTensor parameter's
# `to_local()` (the experts read their EP/ETP-sharded weights so, parallel/expert.py), and TP's
# gradient sum of a replicated weight (parallel/sequence.SumGrad: QK-norms, a sequence-parallel
# router).
_WEIGHT_STEPS = ("ToCopyBackward0", "_ToTorchTensorBackward", "SumGradBackward")


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


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor: what moves, whatever views the tensors on it are."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_bytes(like_B: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    return torch.empty(like_B.numel(), dtype=torch.uint8, device="cpu", pin_memory=pin_memory)


def _device_copy(host_B: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    return torch.empty_like(host_B, device=device).copy_(host_B, non_blocking=non_blocking)


class _Place:
    """Where a DTensor's local shard sits in the whole: unpack wraps the shard brought back in an
    equal DTensor. Not the DTensor itself, which would keep the shard's device memory alive.
    The spec whole, not `from_local` of its placements: a flattened sequence shard (the
    `_StridedShard` a linear saves of its [B, S/tp, D] input) carries a shard order that
    `from_local` does not take, and without it DTensor's backward chose another plan — two
    all-gathers and other rounding (a replicated weight's gradient under sequence parallelism)."""
    __slots__ = ("spec",)

    def __init__(self, t: DTensor):
        self.spec = t._spec

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor(local, self.spec, requires_grad=False)


class _Saved:
    """One saved tensor gone to the host: the copy of its storage (shared with the region's other
    tensors on it) and its view of that storage; a DTensor shard's also its `_Place`."""
    __slots__ = ("copy", "dtype", "offset", "place", "shape", "stride")

    def __init__(self, copy: _Offloaded, local: torch.Tensor, place: _Place | None):
        self.copy, self.dtype, self.place = copy, local.dtype, place
        self.offset, self.shape, self.stride = local.storage_offset(), local.shape, local.stride()

    def view_in(self, storage_B: torch.Tensor) -> torch.Tensor:
        local = storage_B.new_empty(0, dtype=self.dtype)
        local.set_(storage_B.untyped_storage(), self.offset, self.shape, self.stride)
        return local if self.place is None else self.place.wrap(local)


class _Offloaded:
    """A storage's host copy, and what it takes to bring it back. `sharers` tensors were saved on
    it; `restored_B` holds it back on the device until each of them (`unpacked`: their ids) has
    its view; `returned` once backward restored it."""
    __slots__ = ("__weakref__", "copied", "device", "group", "host_B", "prefetched_B", "restored_B",
                 "returned", "sharers", "unpacked")

    def __init__(self, host_B: torch.Tensor, device: torch.device, copied=None, group=None):
        self.host_B, self.device, self.copied, self.group = host_B, device, copied, group
        self.prefetched_B = self.restored_B = None
        self.sharers, self.unpacked, self.returned = 0, set(), False


class HostCopy:
    """Synchronous copies; a CPU storage comes back as its host copy."""

    def __init__(self):
        self.pin_memory = torch.cuda.is_available()

    def begin_group(self) -> None:
        pass

    def accepts(self, t: torch.Tensor) -> bool:
        return True

    def to_host(self, storage_B: torch.Tensor) -> _Offloaded:
        host_B = _host_bytes(storage_B, self.pin_memory and storage_B.device.type != "cpu")
        host_B.copy_(storage_B)
        return _Offloaded(host_B, storage_B.device)

    def to_device(self, packed: _Offloaded) -> torch.Tensor:
        if packed.device.type == "cpu":
            return packed.host_B
        return _device_copy(packed.host_B, packed.device)


class _Group:
    """The storages one region copied, and the group copied before it (weakly)."""

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

    def to_host(self, storage_B: torch.Tensor) -> _Offloaded:
        stream = self._stream(storage_B.device)
        stream.wait_stream(torch.cuda.current_stream(storage_B.device))  # written on that stream
        with torch.cuda.stream(stream):
            host_B = _host_bytes(storage_B, pin_memory=True)
            host_B.copy_(storage_B, non_blocking=True)
        storage_B.record_stream(stream)  # the storage is not reused before the copy ends
        packed = _Offloaded(host_B, storage_B.device, stream.record_event(), self._group)
        self._group.members.append(weakref.ref(packed))
        return packed

    def to_device(self, packed: _Offloaded) -> torch.Tensor:
        group = packed.group
        self._fetch(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None:
            self._fetch(previous)  # backward needs it next: its copies overlap this group's compute
        current = torch.cuda.current_stream(packed.device)
        restored_B, packed.prefetched_B = packed.prefetched_B, None
        if restored_B is None:  # restored a second time: copy again on the compute stream
            current.wait_event(packed.copied)
            return _device_copy(packed.host_B, packed.device, non_blocking=True)
        current.wait_event(group.fetched)
        restored_B.record_stream(current)  # allocated on the side stream, used and freed on this one
        return restored_B

    def _fetch(self, group: _Group) -> None:
        if group.fetched is not None:
            return
        alive = [p for p in (ref() for ref in group.members) if p is not None]
        if not alive:
            return
        stream = self._stream(alive[0].device)
        with torch.cuda.stream(stream):  # after the device→host copies on the same stream
            for p in alive:
                p.prefetched_B = _device_copy(p.host_B, p.device, non_blocking=True)
        group.fetched = stream.record_event()
