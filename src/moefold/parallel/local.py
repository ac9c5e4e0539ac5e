"""This rank's piece of a tensor: the local shard of a DTensor, or the tensor itself."""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """Under parallelism weights, gradients and optimizer states may be DTensors (so that
    checkpoints know where each piece belongs); kernels and element-wise updates run on the local
    piece."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_whole_(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Fill `p` (a plain tensor, or a DTensor holding one piece of its whole value) from `whole`,
    the full tensor, as every rank has it: a DTensor keeps its own piece, cut by its placements
    with no communication (FSDP's strided shards over TP or EP included)."""
    if isinstance(p, DTensor):
        whole = whole.to(p.dtype)  # rounded on the host, as a plain copy_ would round it
        piece = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(piece)
    else:
        p.copy_(whole)
