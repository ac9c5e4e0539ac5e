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
    at a time and computes the gradients then, so it keeps only dh [T, D] and dW [V, D], both in
    the compute dtype, and backward scales them into h's and w's dtypes. The transients are those
    of the eager chunk step (`chunk_loss_and_grad` run as written: train.compile false, or on the
    CPU), op by op; compiled, the step fuses its passes and holds less."""
    s: HeadShapes
    chunk: int

    keeps_weight_cast = False  # forward casts the weight for its GEMMs and keeps none of it

    def saved(self) -> int:
        s = self.s
        return (s.tokens + s.vocab) * s.dim * s.act + FLAG

    def forward_workspace(self) -> int:
        """Beside what it keeps: its input (which nothing keeps) and, where the dtypes differ, the
        weight's and a chunk's input's casts to the compute dtype; then the most of any moment of
        the loop, chunk by chunk (`_moments`), less the kept dW, made at its end."""
        s, C = self.s, min(self.chunk, self.s.tokens)
        held = (s.tokens * s.dim * s.inp + (s.vocab * s.dim * s.act if s.weight != s.act else 0)
                + (C * s.dim * s.act if s.inp != s.act else 0))
        return held + max(self._moments()) - s.vocab * s.dim * s.act

    def _moments(self) -> list[int]:
        """What the loop holds beside the above at each of its moments, chunk by chunk: the dW sum
        (the first chunk's product; fp32 from the second chunk on, its copy made before the
        product), the previous chunk's dlogits (bound until the step returns), and the step
        (`_step`); after it the chunk's dlogits with dh's product, then with dW's; after the loop
        the kept dW's cast. Chunks past the third repeat the third's, but for the last."""
        s = self.s
        C = min(self.chunk, s.tokens)
        n = -(-s.tokens // C)
        rows = [C] * (n - 1) + [s.tokens - C * (n - 1)]
        one, summed = s.vocab * s.dim * s.act, s.vocab * s.dim * FP32
        moments = []
        for k in sorted({1, 2, 3, n} & set(range(1, n + 1))):
            r, before = rows[k - 1], rows[k - 2] * s.vocab * s.act if k > 1 else 0
            held = 0 if k == 1 else one if k == 2 or s.act == FP32 else summed
            moments.append(held + before + self._step(r))
            dlogits = r * s.vocab * s.act
            moments.append(held + dlogits + r * s.dim * s.act)  # dh's rows, before they are copied
            if k == 2 and s.act != FP32:
                moments.append(one + summed + dlogits)  # the sum made fp32
            moments.append((0 if k == 1 else summed) + one + dlogits)
        last = rows[-1] * s.vocab * s.act
        moments.append(last + (one if n == 1 or s.act == FP32 else summed + one))
        return moments

    def _step(self, rows: int) -> int:
        """What `chunk_loss_and_grad` holds at its most on `rows` rows: its fp32 buffer of the
        logits beside the logits (their GEMM's output, let go once copied; none apart in fp32) or
        beside the gradient's cast back, with the rows' mask, clamped labels and log-sum-exp; in
        fp32 (no copy either way) the buffer with those and two of the loss's per-row temporaries."""
        s, V = self.s, self.s.vocab
        if s.act == FP32:
            return rows * (V * FP32 + 1 + INT64 + FP32 + 2 * FP32)
        return rows * (V * (FP32 + s.act) + 1 + INT64 + FP32)

    def backward_workspace(self) -> int:
        """dh and dW scaled by the incoming gradient, in h's and w's dtypes, while the kept ones
        are still held (the new dW becomes the weight's gradient)."""
        s = self.s
        return s.tokens * s.dim * s.inp + s.vocab * s.dim * s.weight

    def freed_in_backward(self) -> int:
        return self.saved() - FLAG

    def grad_workspace(self) -> int:
        """dh, handed to the final norm's backward."""
        return self.s.tokens * self.s.dim * self.s.inp


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
