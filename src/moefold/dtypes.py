"""`cast`: a dtype conversion that never returns its input under a second name.

What an autograd.Function's forward returns goes through it. `x.to(dtype)` of a tensor already in
dtype returns x itself; returned from a Function's forward under torch.compile, that pair (the
product and its no-op conversion, one tensor) makes torch 2.11 route the backward gradient to the
wrong output, and the Function's inputs get zero gradients (pytorch#180642, fixed in 2.12). The GPU
machines run 2.11: fp32 compiled training and every compiled FP8 GEMM lost their gradients to it.
"""

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself when it already is, a converted copy otherwise."""
    return x if x.dtype == dtype else x.to(dtype)
