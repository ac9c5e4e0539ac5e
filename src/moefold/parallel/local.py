"""This rank's piece of a tensor: the local shard of a DTensor, or the tensor itself; and the
small host values a step reads on the device, copied there once (`DeviceCopies`)."""

from collections.abc import Callable, Hashable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """Under parallelism weights, gradients and optimizer states may be DTensors (so that
    checkpoints know where each piece belongs); kernels and element-wise updates run on the local
    piece."""
    return t.to_local() if isinstance(t, DTensor) else t


class DeviceCopies:
    """Host values as device tensors, each copied once per key and device: `torch.tensor(data,
    device=cuda)` copies from pageable memory and waits for the stream (pytorch/pytorch#120996), a
    host sync wherever a step builds one."""

    def __init__(self):
        self._tensors: dict[tuple[Hashable, torch.device], torch.Tensor] = {}

    def on(self, device: torch.device, key: Hashable, values: Callable[[], list]) -> torch.Tensor:
        """`values()` on `device`, read and copied the first time (`key`, `device`) is asked for."""
        if (key, device) not in self._tensors:
            self._tensors[key, device] = torch.tensor(values(), device=device)
        return self._tensors[key, device]


def memory_holder(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage holds `t`'s memory on this rank: a DTensor's local shard (a
    DTensor is a wrapper without storage of its own), read without adding an autograd node, as
    saved-tensor hooks and storage bookkeeping need."""
    return t._local_tensor if isinstance(t, DTensor) else t


def held_indices(p: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dimension of `p`'s whole value, the indices this rank's piece holds, in the piece's
    order (`piece == whole[ix_(*held)]`); None where the piece holds the whole dimension. What a
    rank needs to read or draw of a tensor before it has any of it."""
    if not isinstance(p, DTensor):
        return [None] * p.dim()
    return [_held_along(p, dim) for dim in range(p.dim())]


def _held_along(p: DTensor, dim: int) -> torch.Tensor | None:
    # Sharding one dimension never depends on another's, so the placements that cut `dim`,
    # applied to a 1-D `arange`, cut it as they cut `p` (uneven and strided shards included).
    on_dim = [_as_dim0(pl) if getattr(pl, "dim", None) == dim else Replicate() for pl in p.placements]
    if all(isinstance(pl, Replicate) for pl in on_dim):
        return None
    ids = torch.arange(p.shape[dim])
    return distribute_tensor(ids, p.device_mesh, on_dim, src_data_rank=None).to_local().cpu()


def _as_dim0(placement: Placement) -> Placement:
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    assert isinstance(placement, Shard), f"a parameter placed as {placement}"
    return Shard(0)
