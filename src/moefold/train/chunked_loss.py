"""Output head + next-token cross-entropy in chunks of tokens, without the `[T, V]` logits.

T tokens, D model dim, V vocabulary, C tokens per chunk.

For large vocabularies (Qwen3: 151,936) the logits and their fp32 copies are the largest
activations of a step (about 4·T·V·… bytes). Here forward walks the tokens C at a time: logits of
one chunk (in the compute dtype, fp32 accumulation), their log-sum-exp and loss in fp32, and —
because the loss is the end of the graph — the chunk's gradients right away: dlogits = (softmax −
onehot) / N, then dh = dlogits·W and dW += dlogitsᵀ·h (summed in fp32). Both are kept in the
compute dtype, as the plain head's GEMMs give them; backward only scales them by the incoming
gradient, in the dtypes of h and W. Peak memory holds one chunk's logits instead of all of them;
the GEMMs are the same three per token as the plain head. fp64 inputs stay fp64 throughout (fp32
would round their logits, loss and gradients to 1e-7).

The chunk's cross-entropy and its gradient (`chunk_loss_and_grad`) are elementwise passes over the
[C, V] logits. Run eagerly they work in place in one fp32 copy of them (log-sum-exp adds a
temporary of its own); under `train.compile` their fusible twin (`fused_chunk_loss_and_grad`) is
compiled on its own (`compile_loss`) into passes over the logits in the compute dtype, as the
plain head's compiled loss is.

Labels of IGNORE_INDEX (-100) are ignored (they count neither in the loss nor in N), as in
`F.cross_entropy`; as there, any other label outside [0, V) is refused (`refuse_bad_labels`: an
assert on the device, no host sync; the steps would read a negative one as label 0), and so is a
label count other than the positions'. Without gradients (validation, under torch.no_grad) only
the loss is taken, in the same chunks.
"""

from collections.abc import Callable

import torch

from moefold.data.loader import IGNORE_INDEX


ChunkStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]


def chunk_loss_and_grad(h_CD: torch.Tensor, w_VD: torch.Tensor, labels_C: torch.Tensor,
                        count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's logits h·Wᵀ (in the inputs' dtype, fp32 accumulation), their summed
    cross-entropy over the labelled rows (fp32, or the logits' dtype where wider), and the gradient
    of the mean loss over `count` tokens with respect to them, softmax − one-hot, in the logits'
    dtype. Eager: it works in one such [C, V] buffer, in place."""
    x_CV, dtype = _wide_logits(h_CD, w_VD)
    valid_C, labels_C = labels_C != IGNORE_INDEX, labels_C.clamp(min=0)[:, None]
    loss, lse_C = _loss(x_CV, valid_C, labels_C)
    grad_CV = x_CV.sub_(lse_C[:, None]).exp_()  # softmax
    grad_CV.scatter_add_(1, labels_C, torch.full(labels_C.shape, -1.0, dtype=grad_CV.dtype,  # − one-hot
                                                 device=grad_CV.device))
    grad_CV.mul_(valid_C[:, None]).div_(count)  # labelled rows only, over the micro-batch's count
    return loss, grad_CV.to(dtype)


def fused_chunk_loss_and_grad(h_CD: torch.Tensor, w_VD: torch.Tensor, labels_C: torch.Tensor,
                              count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_loss_and_grad` in pointwise ops and row reductions only, the one-hot a comparison,
    for torch.compile to fuse into passes over the logits (a scatter would make it write the fp32
    buffer out). Bit for bit the same values."""
    x_CV, dtype = _wide_logits(h_CD, w_VD)
    valid_C, labels_C = labels_C != IGNORE_INDEX, labels_C.clamp(min=0)[:, None]
    loss, lse_C = _loss(x_CV, valid_C, labels_C)
    probs_CV = torch.exp(x_CV - lse_C[:, None])
    is_label_CV = torch.arange(x_CV.shape[1], device=x_CV.device) == labels_C
    grad_CV = torch.where(valid_C[:, None], torch.where(is_label_CV, probs_CV - 1.0, probs_CV), 0.0)
    return loss, (grad_CV / count).to(dtype)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss's dtype for logits of `dtype`: fp32, or fp64 for fp64 ones (an fp64 model's loss
    and gradients lost their precision in fp32)."""
    return torch.promote_types(dtype, torch.float32)


def _wide_logits(h_CD: torch.Tensor, w_VD: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The chunk's logits in `wide_dtype`, and their dtype: the GEMM's output is let go once copied."""
    logits_CV = h_CD @ w_VD.T
    return logits_CV.to(wide_dtype(logits_CV.dtype)), logits_CV.dtype


def _loss(x_CV: torch.Tensor, valid_C: torch.Tensor, labels_C1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of the labelled rows, and every row's log-sum-exp."""
    lse_C = torch.logsumexp(x_CV, dim=-1)
    return torch.where(valid_C, lse_C - x_CV.gather(1, labels_C1)[:, 0], 0.0).sum(), lse_C


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, labels_T, chunk: int, compute_dtype, step: ChunkStep):
        count = (labels_T != IGNORE_INDEX).sum().clamp(min=1)
        w_VD = weight_VD.to(compute_dtype)
        # dh and dW are kept in the compute dtype, as the plain head's GEMMs give them: with fp32
        # parameters under autocast that halves what the loss holds from forward to backward.
        grad_h_TD = torch.empty(h_TD.shape, dtype=compute_dtype, device=h_TD.device)
        grad_w_VD = torch.zeros_like(w_VD) if h_TD.shape[0] == 0 else None  # an empty batch: no chunk
        loss = torch.zeros((), dtype=wide_dtype(compute_dtype), device=h_TD.device)
        for start in range(0, h_TD.shape[0], chunk):
            rows = slice(start, start + chunk)
            h_CD = h_TD[rows].to(compute_dtype)
            chunk_loss, grad_CV = step(h_CD, w_VD, labels_T[rows], count)
            loss += chunk_loss
            grad_h_TD[rows] = grad_CV @ w_VD
            # dW: one chunk's is the plain head's GEMM, with no [V, D] fp32 buffer; from the second
            # chunk on the sum is fp32 or wider (made before the product, so the first one's copy is
            # gone by then) and each product is added in place.
            if grad_w_VD is not None:
                grad_w_VD = grad_w_VD.to(wide_dtype(compute_dtype))
            part_VD = grad_CV.T @ h_CD
            grad_w_VD = part_VD if grad_w_VD is None else grad_w_VD.add_(part_VD)
            del part_VD
        ctx.dtypes = h_TD.dtype, weight_VD.dtype
        ctx.save_for_backward(grad_h_TD, grad_w_VD.to(compute_dtype))
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # In the inputs' dtypes, scaled in place: one new tensor each (a copy: a retained graph's
        # next backward reads the kept ones again).
        return grad_h_TD.to(h_dtype, copy=True).mul_(grad_loss), grad_w_VD.to(w_dtype, copy=True).mul_(grad_loss), \
            None, None, None, None


def chunked_linear_cross_entropy(h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor,
                                 chunk: int, step: ChunkStep = chunk_loss_and_grad) -> torch.Tensor:
    """Mean next-token cross-entropy of `h_BSD @ weight_VDᵀ` against `labels_BS`, `chunk` tokens
    at a time; computes in the autocast dtype when autocast is on (as the head would). `step`: the
    chunk's loss and logits' gradient, `chunk_loss_and_grad` or its compiled form."""
    device_type = h_BSD.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else h_BSD.dtype
    _refuse_other_positions(h_BSD, labels_BS)
    refuse_bad_labels(labels_BS, weight_VD.shape[0])
    with torch.autocast(device_type, enabled=False):
        if not torch.is_grad_enabled():  # evaluation: no gradient to take along
            return _mean_loss(h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(), chunk, dtype)
        return _ChunkedLinearCrossEntropy.apply(h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(),
                                                chunk, dtype, step)


def _refuse_other_positions(h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> None:
    """One label per position, as `F.cross_entropy` wants one target per row of logits: the chunks
    walk the positions, and more labels would be left out of the loss but not of its count."""
    positions = h_BSD.shape[:-1].numel()
    if labels_BS.numel() != positions:
        raise ValueError(f"chunked cross-entropy: {labels_BS.numel()} labels {list(labels_BS.shape)} for the "
                         f"{positions} positions of hidden states {list(h_BSD.shape)}; give one label per position")


def refuse_bad_labels(labels_T: torch.Tensor, vocab_size: int) -> None:
    """Raise (CPU) or assert on the device (CUDA, no host sync) unless every label is in
    [0, vocab_size) or IGNORE_INDEX, as `F.cross_entropy` refuses them: the steps clamp ignored
    labels to 0, which would take any other negative one silently as label 0."""
    ok_T = ((labels_T >= 0) & (labels_T < vocab_size)) | (labels_T == IGNORE_INDEX)
    torch._assert_async(ok_T.all(), f"chunked cross-entropy: a label is outside [0, {vocab_size}) "
                                    f"and not the ignore index {IGNORE_INDEX}")


def _mean_loss(h_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor, chunk: int,
               compute_dtype: torch.dtype) -> torch.Tensor:
    """`_ChunkedLinearCrossEntropy`'s loss alone, one chunk's logits at a time."""
    w_VD = weight_VD.to(compute_dtype)
    loss = torch.zeros((), dtype=wide_dtype(compute_dtype), device=h_TD.device)
    for start in range(0, h_TD.shape[0], chunk):
        rows = slice(start, start + chunk)
        x_CV, _ = _wide_logits(h_TD[rows].to(compute_dtype), w_VD)
        labels_C = labels_T[rows]
        loss += _loss(x_CV, labels_C != IGNORE_INDEX, labels_C.clamp(min=0)[:, None])[0]
    return loss / (labels_T != IGNORE_INDEX).sum().clamp(min=1)
