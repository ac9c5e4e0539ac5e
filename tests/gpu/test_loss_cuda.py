"""The training losses on CUDA: the chunked loss (eager, fused step, compiled step) equals the plain
`F.cross_entropy` loss (`LogitsLoss`) and its gradients, makes no host sync in forward or backward
(`torch.cuda.set_sync_debug_mode("error")`: its label check is an assert on the device), and a label
outside [0, V) other than -100 stops the process with a device-side assert, as `F.cross_entropy`
does on CUDA."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from moefold.data import IGNORE_INDEX
from moefold.train.chunked_loss import fused_chunk_loss_and_grad
from moefold.train.loss import ChunkedLoss, LogitsLoss, build_head_loss

pytestmark = pytest.mark.gpu

V, D, B, S = 1000, 64, 2, 96

CHUNKED_LOSSES = {
    "chunked": lambda: ChunkedLoss(40),
    "chunked-fused": lambda: ChunkedLoss(40, fused_chunk_loss_and_grad),
    "chunked-compiled": lambda: build_head_loss(40, compiled=True),
}


def _inputs(seed: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    head = nn.Linear(D, V, bias=False, device="cuda")
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, device="cuda", generator=gen) / D**0.5)
    h_BSD = torch.randn(B, S, D, device="cuda", generator=gen)
    labels_BS = torch.randint(0, V, (B, S), device="cuda", generator=gen)
    labels_BS[0, :17] = IGNORE_INDEX
    return head, h_BSD, labels_BS


def _loss_and_grads(head_loss, head: nn.Linear, h_BSD: torch.Tensor, labels_BS: torch.Tensor):
    head.zero_grad(set_to_none=True)
    h_BSD = h_BSD.clone().requires_grad_()
    loss = head_loss(head, h_BSD, labels_BS)
    loss.backward()
    return loss.detach(), h_BSD.grad, head.weight.grad


@pytest.mark.parametrize("name", list(CHUNKED_LOSSES))
def test_the_chunked_loss_on_cuda_equals_the_plain_loss_without_a_host_sync(name):
    head, h_BSD, labels_BS = _inputs(0)
    head_loss = CHUNKED_LOSSES[name]()
    expected = _loss_and_grads(LogitsLoss(), head, h_BSD, labels_BS)
    _loss_and_grads(head_loss, head, h_BSD, labels_BS)  # warm-up: compilation, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _loss_and_grads(head_loss, head, h_BSD, labels_BS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-4, atol=2e-5)


_BAD_LABEL_SCRIPT = """
import torch
from moefold.train.loss import ChunkedLoss
head = torch.nn.Linear(8, 50, bias=False, device="cuda")
h = torch.randn(1, 10, 8, device="cuda", requires_grad=True)
labels = torch.randint(0, 50, (1, 10), device="cuda")
labels[0, 7] = {bad}
ChunkedLoss(4)(head, h, labels).backward()
torch.cuda.synchronize()
print("NO ASSERT")
"""


@pytest.mark.parametrize("bad", [-1, 50])
def test_a_bad_label_stops_a_cuda_process_with_a_device_assert(bad):
    """Checked in a child process: a device-side assert leaves the CUDA context unusable."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_BAD_LABEL_SCRIPT.format(bad=bad))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "NO ASSERT" not in done.stdout, done.stdout + done.stderr
    assert "assert" in done.stderr.lower(), done.stderr[-2000:]
