"""`compile_loss` (train.compile): the compiled cross-entropy, and the chunked loss's step, give
eager's loss and logits gradient, with ignored labels, for fp32 and bf16 logits. Inductor on the CPU needs a C++ compiler."""

import shutil

import pytest
import torch

from moefold.data import IGNORE_INDEX
from moefold.train.chunked_loss import chunk_loss_and_grad, fused_chunk_loss_and_grad
from moefold.train.compile import compile_loss
from moefold.train.loss import cross_entropy_loss

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="Inductor on the CPU needs a C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_matches_eager(dtype):
    gen = torch.Generator().manual_seed(0)
    logits_BSV = (4 * torch.randn(2, 16, 300, generator=gen)).to(dtype)
    labels_BS = torch.randint(0, 300, (2, 16), generator=gen)
    labels_BS[0, :5] = IGNORE_INDEX  # padding is ignored
    results = []
    for fn in (cross_entropy_loss, compile_loss(cross_entropy_loss)):
        x = logits_BSV.clone().requires_grad_()
        loss = fn(x, labels_BS)
        loss.backward()
        results.append((loss, x.grad))
    (loss, grad), (ref_loss, ref_grad) = results[1], results[0]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert grad.dtype == dtype and (grad[0, :5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_step_matches_eager(dtype):
    """The chunked loss's per-chunk step (train.loss_chunk_tokens) compiled (its fusible twin): the
    same summed loss and logits gradient as the eager in-place step, which test_chunked_loss checks
    against F.cross_entropy; uncompiled the twins agree bit for bit."""
    gen = torch.Generator().manual_seed(1)
    h_CD = (2 * torch.randn(16, 32, generator=gen)).to(dtype)
    w_VD = torch.randn(300, 32, generator=gen).to(dtype)
    labels_C = torch.randint(0, 300, (16,), generator=gen)
    labels_C[:5] = IGNORE_INDEX
    count = torch.tensor(40)  # the micro-batch's labelled tokens, over every chunk
    (loss, grad), (ref_loss, ref_grad) = (compile_loss(fused_chunk_loss_and_grad)(h_CD, w_VD, labels_C, count),
                                          chunk_loss_and_grad(h_CD, w_VD, labels_C, count))
    eager_loss, eager_grad = fused_chunk_loss_and_grad(h_CD, w_VD, labels_C, count)  # the twins agree
    assert torch.equal(eager_loss, ref_loss) and torch.equal(eager_grad, ref_grad)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and (grad[:5] == 0).all()
