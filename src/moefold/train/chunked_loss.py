"""Output head + next-token cross-entropy in chunks of tokens, without the `[T, V]` logits.

T tokens, D model dim, V vocabulary, C tokens per chunk.

For large vocabularies (Qwen3: 151,936) the logits and their fp32 copies are the largest
activations of a step (about 4·T·V·… bytes). Here forward walks the tokens C at a time: logits of
one chunk (in the compute dtype, fp32 accumulation), their log-sum-exp and loss in fp32, and —
because the loss is the end of the graph — the chunk's gradients right away: dlogits = (softmax −
onehot) / N, then dh = dlogits·W and dW += dlogitsᵀ·h. Backward only scales the saved dh and dW by
the incoming gradient. Peak memory holds one chunk's logits instead of all of them; the GEMMs are
the same three per token as the plain head.

Labels of IGNORE_INDEX (-100) are ignored (they count neither in the loss nor in N), as in
`F.cross_entropy`.
"""

import torch

from moefold.data.loader import IGNORE_INDEX


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, labels_T, chunk: int, compute_dtype):
        valid_T = labels_T != IGNORE_INDEX
        count = valid_T.sum().clamp(min=1)
        w_VD = weight_VD.to(compute_dtype)
        grad_h_TD = torch.empty_like(h_TD)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, h_TD.shape[0], chunk):
            rows = slice(start, start + chunk)
            h_CD = h_TD[rows].to(compute_dtype)
            logits_CV = (h_CD @ w_VD.T).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            valid_C, labels_C = valid_T[rows], labels_T[rows].clamp(min=0)
            target_C = logits_CV.gather(1, labels_C[:, None])[:, 0]
            loss += torch.where(valid_C, lse_C - target_C, 0.0).sum()
            # d(loss)/d(logits) = softmax − onehot, for valid rows, over N tokens
            grad_CV = torch.exp(logits_CV - lse_C[:, None])
            grad_CV.scatter_add_(1, labels_C[:, None], torch.full_like(lse_C[:, None], -1.0))
            grad_CV = torch.where(valid_C[:, None], grad_CV, 0.0).div_(count).to(compute_dtype)
            grad_h_TD[rows] = (grad_CV @ w_VD).to(h_TD.dtype)
            grad_w_VD += (grad_CV.T @ h_CD).float()
        ctx.save_for_backward(grad_h_TD, grad_w_VD.to(weight_VD.dtype))
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        return grad_h_TD * grad_loss.to(grad_h_TD.dtype), grad_w_VD * grad_loss.to(grad_w_VD.dtype), \
            None, None, None


def chunked_linear_cross_entropy(h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor,
                                 chunk: int) -> torch.Tensor:
    """Mean next-token cross-entropy of `h_BSD @ weight_VDᵀ` against `labels_BS`, `chunk` tokens
    at a time; computes in the autocast dtype when autocast is on (as the head would)."""
    device_type = h_BSD.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else h_BSD.dtype
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h_BSD.flatten(0, 1), weight_VD, labels_BS.flatten(),
                                                chunk, dtype)
