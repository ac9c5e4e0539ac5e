"""`cast`: a dtype conversion that never returns its input under a second name;
`KeepsBufferDtypes`: a module whose buffers a cast of the model leaves in their dtypes.

What an autograd.Function's forward returns goes through it. `x.to(dtype)` of a tensor already in
dtype returns x itself; returned from a Function's forward under torch.compile, that pair (the
product and its no-op conversion, one tensor) makes torch 2.11 route the backward gradient to the
wrong output, and the Function's inputs get zero gradients (pytorch#180642, fixed in 2.12). The GPU
machines run 2.11: fp32 compiled training and every compiled FP8 GEMM lost their gradients to it.
"""

import torch
from torch import nn


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself when it already is, a converted copy otherwise."""
    return x if x.dtype == dtype else x.to(dtype)


class KeepsBufferDtypes(nn.Module):
    """A module whose own buffers keep their dtypes when the model is cast (model.to(torch.bfloat16)):
    in bf16 a sum of ones stops growing past 256 and an update of 1e-3 vanishes past 0.5, so the
    MoE layers' fp32 statistics and the router's expert bias stay fp32, with their values (not
    cast back from bf16's). Moves between devices still apply."""

    def _apply(self, fn, recurse=True):
        buffers = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)  # replaces each buffer by fn(buffer), leaving the old one whole
        for name, buf in buffers.items():
            new = self._buffers[name]
            if new.dtype != buf.dtype:  # the old values, where fn put the cast ones
                self._buffers[name] = buf.to(new.device)
        return self
