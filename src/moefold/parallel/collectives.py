"""torch.distributed's flat collectives under one name on every supported torch.

torch 2.13 deprecates `all_gather_into_tensor` and `reduce_scatter_tensor` (a FutureWarning on
every call) for `all_gather_single` and `reduce_scatter_single`, which torch 2.11 (the GPU
machines') does not have yet: the same arguments, the same collective. Likewise the functional,
autograd-aware `reduce_scatter_tensor_autograd` for `reduce_scatter_single_autograd`.
"""

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
reduce_scatter_single_autograd = (getattr(funcol, "reduce_scatter_single_autograd", None)
                                  or funcol.reduce_scatter_tensor_autograd)

__all__ = ["all_gather_single", "reduce_scatter_single", "reduce_scatter_single_autograd"]
