"""Output head + next-token cross-entropy in chunks of tokens, without the `[T, V]` logits.

T tokens, D model dim, V vocabulary, C tokens per chunk.

For large vocabularies (Qwen3: 151,936) the logits and their fp32 copies are the largest
activations of a step (about 4·T·V·… bytes). Here forward walks the tokens C at a time: logits of
one chunk (in the compute dtype, fp32 accumulation), their log-sum-exp and loss in fp32, and —
because the loss is the end of the graph — the chunk's gradients right away: dlogits = (softmax −
onehot) / N, then dh = dlogits·W and dW += dlogitsᵀ·h. Backward only scales the saved dh and dW by
the incoming gradient. Peak memory holds one chunk's logits instead of all of them; the GEMMs are
the same three per token as the plain head.

The chunk's cross-entropy and its gradient (`chunk_loss_and_grad`) are elementwise passes over the
[C, V] logits. Run eagerly they write and read fp32 copies, about 40 bytes per logit; `train.compile`
compiles that function on its own (`compile_loss`), which fuses it into passes over the logits in
the compute dtype, as the plain head's compiled loss does.

Labels of IGNORE_INDEX (-100) are ignored (they count neither in the loss nor in N), as in
`F.cross_entropy`.
"""

from collections.abc import Callable

import torch

from moefold.data.loader import IGNORE_INDEX


ChunkStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_loss_and_grad(logits_CV: torch.Tensor, labels_C: torch.Tensor,
                        count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy over its labelled rows (fp32) and the gradient of the mean
    loss over `count` tokens with respect to its logits, softmax − one-hot, in the logits' dtype.
    Pointwise ops and row reductions only, which torch.compile fuses."""
    x_CV = logits_CV.float()
    valid_C, labels_C = labels_C != IGNORE_INDEX, labels_C.clamp(min=0)
    lse_C = torch.logsumexp(x_CV, dim=-1)
    target_C = x_CV.gather(1, labels_C[:, None])[:, 0]
    loss = torch.where(valid_C, lse_C - target_C, 0.0).sum()
    probs_CV = torch.exp(x_CV - lse_C[:, None])
    is_label_CV = torch.arange(x_CV.shape[1], device=x_CV.device) == labels_C[:, None]
    grad_CV = torch.where(valid_C[:, None], torch.where(is_label_CV, probs_CV - 1.0, probs_CV), 0.0)
    return loss, (grad_CV / count).to(logits_CV.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, labels_T, chunk: int, compute_dtype, step: ChunkStep):
        count = (labels_T != IGNORE_INDEX).sum().clamp(min=1)
        w_VD = weight_VD.to(compute_dtype)
        grad_h_TD = torch.empty_like(h_TD)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, h_TD.shape[0], chunk):
            rows = slice(start, start + chunk)
            h_CD = h_TD[rows].to(compute_dtype)
            chunk_loss, grad_CV = step(h_CD @ w_VD.T, labels_T[rows], count)  # logits in fp32 accumulation
            loss += chunk_loss
            grad_h_TD[rows] = (grad_CV @ w_VD).to(h_TD.dtype)
            grad_w_VD.add_(grad_CV.T @ h_CD)  # in fp32, with no fp32 copy of the [V, D] product
        ctx.save_for_backward(grad_h_TD, grad_w_VD.to(weight_VD.dtype))
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        return grad_h_TD * grad_loss.to(grad_h_TD.dtype), grad_w_VD * grad_loss.to(grad_w_VD.dtype), \
            None, None, None, None


def chunked_linear_cross_entropy(h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor,
                                 chunk: int, step: ChunkStep = chunk_loss_and_grad) -> torch.Tensor:
    """Mean next-token cross-entropy of `h_BSD @ weight_VDᵀ` against `labels_BS`, `chunk` tokens
    at a time; computes in the autocast dtype when autocast is on (as the head would). `step`: the
    chunk's loss and logits' gradient, `chunk_loss_and_grad` or its compiled form."""
    device_type = h_BSD.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else h_BSD.dtype
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(),
                                                chunk, dtype, step)
