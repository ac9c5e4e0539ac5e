"""memory.offload on CUDA moves storages, not tensors: within a region each storage goes to pinned
host memory once, on the side stream, and every tensor saved on it comes back as a view of one
restored device storage; gradients stay bit-identical and nothing stays on the host after backward
(the CPU path's tests: tests/unit/test_offload.py)."""

import weakref

import pytest
import torch

from moefold.memory.offload import ActivationOffload, StreamedHostCopy

pytestmark = pytest.mark.gpu


def test_views_of_one_storage_share_one_copy_each_way():
    base = torch.randn(4, 6, 10, device="cuda")
    offload = ActivationOffload(0, StreamedHostCopy())
    views = (base, base, base.split([7, 3], dim=-1)[0], base.transpose(0, 2), base[:, 1],
             base.view(torch.int32)[1:])
    with offload.region():
        packed = [offload.pack(v) for v in views]
    back = [offload.unpack(p) for p in packed]
    assert offload.offloaded_bytes == base.untyped_storage().nbytes()  # counted when brought back
    torch.cuda.synchronize()
    for b, v in zip(back, views):
        assert b.is_cuda and torch.equal(b, v)
        assert (b.dtype, b.shape, b.stride(), b.storage_offset()) == \
            (v.dtype, v.shape, v.stride(), v.storage_offset())
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1
    assert back[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_a_region_of_shared_storages_trains_bit_identically_and_leaves_no_host_copy():
    gen = torch.Generator(device="cuda").manual_seed(0)
    a_TD, w_DF2, w_FD = (torch.randn(*shape, device="cuda", generator=gen, requires_grad=True)
                         for shape in ((256, 64), (64, 512), (256, 64)))

    def swiglu(x_TD):  # x saved twice, the gate and up halves of one fused output
        g_TF, u_TF = (x_TD @ w_DF2).chunk(2, dim=-1)
        return ((torch.nn.functional.silu(g_TF) * u_TF) @ w_FD + x_TD @ w_DF2[:, :1]).sum()

    plain = torch.autograd.grad(swiglu(a_TD * 1.0), (a_TD, w_DF2, w_FD))
    offload = ActivationOffload(0, StreamedHostCopy())
    host_copies = []
    to_host = offload.copier.to_host

    def recording_to_host(storage_B):
        packed = to_host(storage_B)
        host_copies.append(weakref.ref(packed.host_B))
        return packed
    offload.copier.to_host = recording_to_host
    with offload.region():
        loss = swiglu(a_TD * 1.0)
    assert len(host_copies) == 4
    grads = torch.autograd.grad(loss, (a_TD, w_DF2, w_FD))
    assert offload.offloaded_bytes == 4 * 256 * (64 + 512 + 256 + 256)  # counted when brought back
    torch.cuda.synchronize()
    assert all(torch.equal(g, p) for g, p in zip(grads, plain))
    assert not any(h() for h in host_copies)
