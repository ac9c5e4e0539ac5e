"""The output head and its loss, once per head (the trunk's, then each MTP depth's), as the trainer
builds them (train/loss.py's `build_head_loss`): `LogitsHead`, the [T, V] logits and their
cross-entropy, or, with train.loss_chunk_tokens > 0, `ChunkedHead` (train/chunked_loss.py). Each
says what the head keeps for backward (to the byte: plan.measure counts it) and what it holds for a
while at the loss, in forward and in backward (plan.peaks follows it).

T tokens, D model dim, V vocabulary, C tokens per chunk. Bytes per element: `a` the compute dtype,
`h` the head's input (the final norm's output, in the residual stream's dtype: fp32 for the trunk
with fp32 parameters under autocast, the compute dtype for an MTP depth), `w` the head weight as
forward reads it (the parameter's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moefold.config import Config

if TYPE_CHECKING:
    from moefold.plan.activations import Shapes

FP32, INT64 = 4, 8
FLAG = 1  # loss_or_zero's bool (models/mtp.py): whether any label is not ignored


@dataclass(frozen=True)
class HeadShapes:
    """One head's sizes, and its bytes per element."""
    tokens: int  # T: every head runs on all the rank's tokens (no sequence parallelism)
    dim: int  # D
    vocab: int  # V
    act: int  # a
    inp: int  # h
    weight: int  # w


@dataclass(frozen=True)
class LogitsHead:
    """The head's [T, V] logits, then the fp32 cross-entropy (`LogitsLoss`): it keeps its input
    (autocast's cast of it), the fp32 log-probabilities, the labels and the loss weight."""
    s: HeadShapes

    keeps_weight_cast = True  # autocast's cast of the head weight (one for every head: it caches it)

    def saved(self) -> int:
        s = self.s
        return s.tokens * s.dim * s.act + s.tokens * s.vocab * FP32 + s.tokens * INT64 + FP32 + FLAG

    def forward_workspace(self) -> int:
        """The logits in the compute dtype and their fp32 copy (none in fp32), beside the kept
        log-probabilities; and an input in another dtype than the compute dtype (fp32 under
        autocast), which nothing keeps (the head keeps its cast)."""
        s = self.s
        logits = s.tokens * s.vocab * (s.act + (0 if s.act == FP32 else FP32))
        return logits + (s.tokens * s.dim * s.inp if s.inp != s.act else 0)

    def backward_workspace(self) -> int:
        """The fp32 gradients of the log-probabilities (nll's, dense) and of the logits
        (log-softmax's), while the log-probabilities are still held."""
        return 2 * self.s.tokens * self.s.vocab * FP32

    def freed_in_backward(self) -> int:
        return self.s.tokens * self.s.vocab * FP32  # the log-probabilities

    def grad_workspace(self) -> int:
        """The logits' gradient in the compute dtype, which the head's backward reads."""
        return self.s.tokens * self.s.vocab * self.s.act


@dataclass(frozen=True)
class ChunkedHead:
    """The chunked head + loss (`ChunkedLoss`, train.loss_chunk_tokens): forward walks the tokens C
    at a time and computes the gradients then, so it keeps only dh [T, D] (h's dtype) and dW
    [V, D] (w's dtype), and backward scales them. The transients are those of the eager chunk
    step (`chunk_loss_and_grad` run as written: train.compile false, or on the CPU), op by op;
    compiled, the step fuses its passes and holds less."""
    s: HeadShapes
    chunk: int

    keeps_weight_cast = False  # forward casts the weight for its GEMMs and keeps none of it

    def saved(self) -> int:
        s = self.s
        return s.tokens * s.dim * s.inp + s.vocab * s.dim * s.weight + FLAG

    def forward_workspace(self) -> int:
        """Beside what it keeps: its input (which nothing keeps) and, where the dtypes differ, the
        weight's and each chunk's input's casts to the compute dtype, and the fp32 dW it
        accumulates where the kept one is not fp32; then the largest of three moments: a chunk's
        step, its dW product, the kept dW's cast."""
        s, C = self.s, min(self.chunk, self.s.tokens)
        held = (s.tokens * s.dim * s.inp + s.vocab * s.dim * (FP32 - s.weight)
                + (s.vocab * s.dim * s.act if s.weight != s.act else 0)
                + (C * s.dim * s.act if s.inp != s.act else 0))
        last = s.tokens - C * ((s.tokens - 1) // C)  # the last chunk's rows
        cast_dw = s.vocab * s.dim * s.weight if s.weight != FP32 else 0
        return held + max(self._step_peak(),
                          C * s.vocab * s.act + s.vocab * s.dim * s.act,  # dlogitsᵀ·h in the compute dtype
                          last * s.vocab * s.act + cast_dw)  # the last chunk's dlogits still bound

    def _step_peak(self) -> int:
        """The most a chunk step holds: its logits and the ops of `chunk_loss_and_grad` (per logit,
        `step_bytes`; per row its mask, clamped labels, log-sum-exp and target logit), with the
        previous chunk's dlogits still bound in the loop. The largest is the second chunk's (its
        predecessor is full) or, in one chunk, the first."""
        s, C = self.s, self.chunk
        per_row = s.vocab * step_bytes(s.act) + 1 + INT64 + 2 * FP32
        if s.tokens <= C:
            return s.tokens * per_row
        return max(C * per_row, C * s.vocab * s.act + min(C, s.tokens - C) * per_row)

    def backward_workspace(self) -> int:
        """dh and dW scaled by the incoming gradient while the kept ones are still held (the new
        dW becomes the weight's gradient)."""
        s = self.s
        return s.tokens * s.dim * s.inp + s.vocab * s.dim * s.weight

    def freed_in_backward(self) -> int:
        return self.saved() - FLAG

    def grad_workspace(self) -> int:
        """dh, handed to the final norm's backward."""
        return self.s.tokens * self.s.dim * self.s.inp


def step_bytes(act: int) -> int:
    """Bytes per logit the eager `chunk_loss_and_grad` holds at its most: the logits (a) and their
    fp32 copy (none in fp32), the probabilities (4), the one-hot mask (1), the gradient and its
    division by the token count (4 + 4) and, in a lower precision, its cast back (a). Torch's
    log-sum-exp makes an fp32 [C, V] temporary of its own, earlier, while less is held."""
    if act == FP32:
        return FP32 + FP32 + 1 + 2 * FP32
    return act + FP32 + FP32 + 1 + 2 * FP32 + act


Head = LogitsHead | ChunkedHead


def head_losses(cfg: Config, sh: Shapes, vocab: int) -> list[Head]:
    """The trunk's head and each MTP depth's, in forward order, on the rank's T tokens. The trunk's
    input is in the residual stream's dtype (the parameters'), an MTP depth's in the compute dtype
    (its projection's output); the head weight in the parameters' dtype."""
    m, chunk = cfg.model, cfg.train.loss_chunk_tokens
    heads = []
    for depth in range(1 + m.mtp_layers):
        s = HeadShapes(sh.tokens, m.dim, vocab, sh.act_bytes, sh.params if depth == 0 else sh.act_bytes,
                       sh.params)
        heads.append(ChunkedHead(s, chunk) if chunk > 0 else LogitsHead(s))
    return heads
