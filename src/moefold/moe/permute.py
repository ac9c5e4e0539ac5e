"""Static-shape permutation of routed token copies by expert, and its inverse.

T tokens, K top-k, N = T·K routed copies, D model dim.
A stable argsort over the fixed-size `[N]` expert-id vector groups copies by expert with no host
sync and no data-dependent shapes (no masked_select, no .tolist()).
"""

import torch


def sort_by_expert(idx_TK: torch.Tensor) -> torch.Tensor:
    """order_N: the routed copies (flattened t·K + k) sorted by expert id, stable within an expert."""
    return torch.argsort(idx_TK.reshape(-1), stable=True)


def permute(x_TD: torch.Tensor, order_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """x_ND: each token's row repeated for its K experts, grouped by expert."""
    return x_TD.index_select(0, order_N // top_k)


def unpermute(y_ND: torch.Tensor, order_N: torch.Tensor, probs_TK: torch.Tensor) -> torch.Tensor:
    """y_TD = Σ_k probs_TK · (expert output of copy (t, k)), summed in fp32.

    Gathering through the inverse permutation (rather than scatter-adding) keeps the forward
    deterministic; its backward scatters into distinct rows, so it is deterministic too.
    """
    T, K = probs_TK.shape
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    y_TKD = y_ND.index_select(0, inverse_N).view(T, K, -1)
    return torch.einsum("tkd,tk->td", y_TKD.float(), probs_TK.float())
