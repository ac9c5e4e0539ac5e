"""The MoE layer's EP=1 training path calls no op that synchronises with the host on CUDA, checked
on the CPU in CI: a dispatch mode refuses the ops that read a device value back to the host
(`.item()`, `.tolist()`, `nonzero`, boolean masks, `unique`, `repeat_interleave` without its output
size). The GPU test (tests/gpu/test_moe_sync_free.py, `set_sync_debug_mode("error")`) also catches
syncs inside CUDA kernels; this one guards every change on the machine without a GPU."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_reference import build, random_config

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
              aten.index.Tensor}  # index.Tensor: refused only with a boolean index (below)


class RefuseHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS and self._syncs(func, args, kwargs):
            raise AssertionError(f"{func} reads a device value on the host (a CUDA sync)")
        return func(*args, **kwargs)

    @staticmethod
    def _syncs(func, args, kwargs) -> bool:
        if func is aten.index.Tensor:
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return True


def test_the_guard_catches_a_host_read():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), RefuseHostReads():
        torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="index"), RefuseHostReads():
        torch.arange(4)[torch.arange(4) > 1]


@pytest.mark.parametrize("seed", range(4))
def test_dropless_grouped_mm_layer_reads_nothing_back(seed):
    # The GPU test's configuration: dropless, unpadded, training mode with aux losses on.
    cfg = dataclasses.replace(random_config(seed), expert_hidden=16, experts_backend="grouped_mm",
                              capacity_factor=0.0, pad_to_capacity=False, pad_multiple=0,
                              aux_loss_coeff=0.01, z_loss_coeff=0.001)
    layer = build(cfg, 32, seed).float().train()
    x_BSD = torch.randn(2, 64, 32, requires_grad=True)
    with RefuseHostReads():
        y_BSD = layer(x_BSD)
        (y_BSD * torch.randn_like(y_BSD)).sum().backward()
    assert x_BSD.grad is not None and torch.isfinite(x_BSD.grad).all()
