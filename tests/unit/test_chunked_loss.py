"""The chunked output head + cross-entropy against the plain head and `F.cross_entropy`."""

import pytest
import torch
import torch.nn.functional as F

from moefold.config import load_config
from moefold.data import IGNORE_INDEX
from moefold.models.transformer import build_model
from moefold.train.chunked_loss import chunked_linear_cross_entropy
from moefold.train.loss import ChunkedLoss, LogitsLoss, NextTokenAndMTPLoss, NextTokenLoss, build_head_loss, build_objective, cross_entropy_loss, next_token_loss


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])  # uneven last chunk, one chunk for all
def test_matches_plain_head_and_cross_entropy(chunk):
    """fp32 inputs: the loss works in fp32 for inputs of fp32 or narrower (fp64 in fp64, 83de019)."""
    gen = torch.Generator().manual_seed(chunk)
    B, S, D, V = 3, 21, 16, 50
    h = torch.randn(B, S, D, dtype=torch.float32, generator=gen, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float32, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # ignored positions count neither in the loss nor in the mean
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w_ref.T).flatten(0, 1), labels.flatten())
    loss = chunked_linear_cross_entropy(h, w, labels, chunk)
    upstream = torch.tensor(1.7)
    (ref * upstream).backward()
    (loss * upstream).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-6)


def test_objective_trains_like_the_plain_one():
    """A few SGD steps of a tiny model: same losses and weights as the plain head and loss."""
    cfg = load_config("tiny", {"model.vocab_size": "64"})
    torch.manual_seed(0)
    plain, chunked = build_model(cfg, 64), build_model(cfg, 64)
    plain.init_weights(seed=1)
    chunked.load_state_dict(plain.state_dict())
    chunked_objective = build_objective(chunked, build_head_loss(16))
    assert isinstance(chunked_objective.head_loss, ChunkedLoss)
    objective = build_objective(plain, build_head_loss(0))
    assert isinstance(objective, NextTokenLoss) and objective.head_loss.loss_fn is cross_entropy_loss
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 24), generator=gen)
        losses = []
        for model, objective in ((plain, next_token_loss), (chunked, NextTokenLoss(ChunkedLoss(10)))):
            loss, _ = objective(model, ids[:, :-1], ids[:, 1:])
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_mtp_depths_take_the_chunked_loss_too():
    """A model with MTP modules under train.loss_chunk_tokens: the trunk's head and every depth's
    go through the chunked loss, with the plain objective's losses and gradients."""
    cfg = load_config("tiny-deepseek", {"model.n_layers": 2, "model.mtp_layers": 2, "moe.experts_backend": "loop",
                                        "moe.router_dtype": "fp64"})  # in fp64
    torch.manual_seed(0)
    model = build_model(cfg, 64).double()
    model.init_weights(seed=1)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    results = []
    for head_loss in (LogitsLoss(), ChunkedLoss(7)):
        objective = build_objective(model, head_loss)
        assert isinstance(objective, NextTokenAndMTPLoss) and objective.head_loss is head_loss
        total, parts = objective(model, ids[:, :-1], ids[:, 1:])
        total.backward()
        results.append((parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
    (plain_parts, plain_grads), (parts, grads) = results
    # within test_matches_plain_head_and_cross_entropy's fp32 tolerances
    for key in ("lm_loss", "mtp_loss"):
        torch.testing.assert_close(parts[key], plain_parts[key], rtol=1e-5, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [48, 100])  # one chunk; three, the last short
def test_kept_gradients_are_in_the_compute_dtype(chunk):
    """fp32 parameters under bf16 autocast (the default optimizer on a GPU): the chunked loss keeps
    dh and dW in bf16, as the plain head's GEMMs give them (half the bytes of fp32 ones), and
    backward hands fp32 gradients that match the plain autocast head's within bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 24, 32, generator=gen, requires_grad=True)
    w = (0.3 * torch.randn(70, 32, generator=gen)).requires_grad_()
    labels = torch.randint(0, 70, (2, 24), generator=gen)
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = chunked_linear_cross_entropy(h, w, labels, chunk)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.bfloat16, (48, 32)), (torch.bfloat16, (70, 32))]
    (2.5 * loss).backward()
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = h_ref @ w_ref.T
    (2.5 * F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())).backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).detach(),
                               rtol=1e-5, atol=1e-5)
    for grad, ref in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):  # bf16 GEMMs, rounded apart: 2 ulps
        torch.testing.assert_close(grad, ref, rtol=2 ** -7, atol=2 ** -8 * ref.abs().max().item())


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_without_gradients_the_loss_is_the_same(chunk):
    """Evaluation (validation) under torch.no_grad takes the loss alone, chunk by chunk: the value
    of `F.cross_entropy`, ignored labels left out, the last short chunk included."""
    gen = torch.Generator().manual_seed(chunk)
    h = torch.randn(3, 21, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (3, 21), generator=gen)
    labels[1, 3:] = IGNORE_INDEX
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, labels, chunk)
        ref = F.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten())
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, chunked_linear_cross_entropy(h, w, labels, chunk).detach(), rtol=0, atol=0)
