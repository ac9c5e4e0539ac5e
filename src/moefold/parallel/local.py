"""This rank's piece of a tensor: the local shard of a DTensor, or the tensor itself."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """Under parallelism weights, gradients and optimizer states may be DTensors (so that
    checkpoints know where each piece belongs); kernels and element-wise updates run on the local
    piece."""
    return t.to_local() if isinstance(t, DTensor) else t
