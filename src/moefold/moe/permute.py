"""Static-shape permutation of routed token copies into per-expert row groups, and back.

T tokens, K top-k, N = T·K routed copies, E experts, D model dim, R rows of the expert buffer.
Copies are ordered by expert with a stable argsort over the fixed-size `[N]` key, with no host sync
and no data-dependent shape (no masked_select, .nonzero() or .tolist()). The buffer has a size fixed
by the config, not by the routing:

- dropless: R = N, groups back to back;
- `pad_multiple` m: each group padded with zero rows to a multiple of m (R = N + E·(m−1));
- `pad_to_capacity`: every group exactly C rows (R = E·C).

Dropped copies (over capacity, or padding tokens) get no row. Rows past the last group are left for
the experts to skip (torch._grouped_mm never writes them) and are never read back.

Every move is a row gather whose backward is again a gather through the inverse map
(`gather_rows`), never `index_select`'s scatter-add backward: no atomics, deterministic, and the K
copies of a token are summed by one reduction (fp32 accumulation) instead of K read-modify-writes.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class PermutePlan:
    """Where every copy goes; built once per layer call, used by dispatch and combine."""
    copy_of_row_R: torch.Tensor  # int64: the copy (t·K + k) held by each row; 0 where none
    row_valid_R: torch.Tensor  # bool: the row holds a kept copy (not padding, not past the end)
    row_of_copy_N: torch.Tensor  # int64: each copy's row; 0 for dropped copies
    keep_N: torch.Tensor  # bool: the copy was kept
    rows_per_expert_E: torch.Tensor  # int64: group sizes including padding (for the GEMM offsets)


class RowLayout:
    """How many rows each expert's group gets: a strategy fixed when the layer is built.

    `capacity_of(num_tokens)` is given for pad-to-capacity: every group then has exactly that many
    rows (rounded up to the multiple)."""

    def __init__(self, num_experts: int, top_k: int, pad_multiple: int = 0,
                 capacity_of: Callable[[int], int] | None = None):
        self.num_experts, self.top_k = num_experts, top_k
        self.multiple, self.capacity_of = max(1, pad_multiple), capacity_of

    def num_rows(self, num_copies: int) -> int:
        if self.capacity_of is not None:
            return self.num_experts * self._padded_capacity(num_copies)
        return num_copies + self.num_experts * (self.multiple - 1)

    def group_sizes(self, kept_per_expert_E: torch.Tensor, num_copies: int) -> torch.Tensor:
        if self.capacity_of is not None:
            return torch.full_like(kept_per_expert_E, self._padded_capacity(num_copies))
        m = self.multiple
        return (kept_per_expert_E + m - 1) // m * m

    def of_slice(self, slices: int) -> "RowLayout":
        """The layout for one of `slices` equal slices of tokens whose capacity drop ran on all of
        them (SequenceSplitDispatcher): groups padded to the whole tokens' capacity, since one slice
        may hold every copy an expert kept."""
        if self.capacity_of is None:
            return self
        whole = self.capacity_of
        return RowLayout(self.num_experts, self.top_k, self.multiple,
                         capacity_of=lambda num_tokens: whole(num_tokens * slices))

    def _padded_capacity(self, num_copies: int) -> int:
        capacity = self.capacity_of(num_copies // self.top_k)
        return (capacity + self.multiple - 1) // self.multiple * self.multiple


def plan_permutation(idx_TK: torch.Tensor, keep_N: torch.Tensor, layout: RowLayout) -> PermutePlan:
    E = layout.num_experts
    idx_N = idx_TK.reshape(-1)
    N = idx_N.numel()
    key_N = torch.where(keep_N, idx_N, E)  # dropped copies sort after every expert
    order_N = torch.argsort(key_N, stable=True)
    key_sorted_N = key_N[order_N]

    kept_per_expert_E = torch.zeros(E + 1, dtype=torch.int64, device=idx_N.device)
    kept_per_expert_E.scatter_add_(0, key_N, torch.ones_like(key_N))
    kept_per_expert_E = kept_per_expert_E[:E]
    rows_per_expert_E = layout.group_sizes(kept_per_expert_E, N)
    kept_start_E1 = _exclusive_cumsum(kept_per_expert_E)
    row_start_E1 = _exclusive_cumsum(rows_per_expert_E)

    R = layout.num_rows(N)
    rank_N = torch.arange(N, device=idx_N.device) - kept_start_E1[key_sorted_N]
    row_sorted_N = torch.where(key_sorted_N < E, row_start_E1[key_sorted_N] + rank_N, R)
    row_of_copy_N = torch.empty_like(row_sorted_N).index_put_((order_N,), row_sorted_N)

    # One spare slot at index R absorbs the dropped copies' writes.
    copy_of_row_R1 = torch.zeros(R + 1, dtype=torch.int64, device=idx_N.device)
    copy_of_row_R1[row_of_copy_N] = torch.arange(N, device=idx_N.device)
    row_valid_R1 = torch.zeros(R + 1, dtype=torch.bool, device=idx_N.device)
    row_valid_R1[row_of_copy_N] = keep_N
    return PermutePlan(copy_of_row_R=torch.where(row_valid_R1[:R], copy_of_row_R1[:R], 0),
                       row_valid_R=row_valid_R1[:R],
                       row_of_copy_N=torch.where(keep_N, row_of_copy_N, 0),
                       keep_N=keep_N, rows_per_expert_E=rows_per_expert_E)


def _exclusive_cumsum(counts_E: torch.Tensor) -> torch.Tensor:
    """[0, c0, c0+c1, ...]: E+1 entries (the last is the total) so index E is valid too."""
    return torch.cat([counts_E.new_zeros(1), counts_E.cumsum(0)])


class _GatherRows(torch.autograd.Function):
    """out_YD = src_XD[index_Y] (zero where not valid_Y), with the backward a gather too:
    grad_src_XD[x] = Σ_c grad_out_YD[back_index_XC[x, c]] over the c where back_valid_XC holds.
    The caller guarantees the maps are inverse: every valid output row appears exactly once in
    back_index_XC (valid there), pointing back at its source row."""

    @staticmethod
    def forward(ctx, src_XD, index_Y, valid_Y, back_index_XC, back_valid_XC):
        ctx.save_for_backward(back_index_XC, back_valid_XC)
        out_YD = _index_rows(src_XD, index_Y)
        return out_YD if valid_Y is None else torch.where(valid_Y[:, None], out_YD, 0)

    @staticmethod
    def backward(ctx, grad_YD):
        back_index_XC, back_valid_XC = ctx.saved_tensors
        X, C = back_index_XC.shape
        grad_XCD = _index_rows(grad_YD, back_index_XC.reshape(-1)).view(X, C, grad_YD.shape[-1])
        if back_valid_XC is not None:
            grad_XCD = torch.where(back_valid_XC[..., None], grad_XCD, 0)
        return (grad_XCD[:, 0] if C == 1 else grad_XCD.sum(dim=1)), None, None, None, None


def _index_rows(src_XD: torch.Tensor, index_Y: torch.Tensor) -> torch.Tensor:
    """src_XD.index_select(0, index_Y) (rows, or elements of a vector); zeros when src has none: a
    rank without tokens (a data rank left no validation sequence) still has its padded groups'
    rows, all masked, each at index 0."""
    if src_XD.shape[0] == 0:
        return src_XD.new_zeros(index_Y.shape[0], *src_XD.shape[1:])
    return src_XD.index_select(0, index_Y)


def gather_rows(src_XD: torch.Tensor, index_Y: torch.Tensor, back_index_XC: torch.Tensor,
                valid_Y: torch.Tensor | None = None,
                back_valid_XC: torch.Tensor | None = None) -> torch.Tensor:
    """`src_XD.index_select(0, index_Y)`, zeroed where not `valid_Y`, whose gradient is gathered
    back through the inverse map `back_index_XC` (C output rows per source row) instead of
    scatter-added (see _GatherRows)."""
    return _GatherRows.apply(src_XD, index_Y, valid_Y, back_index_XC, back_valid_XC)


def permute(x_TD: torch.Tensor, plan: PermutePlan, top_k: int) -> torch.Tensor:
    """x_RD: each kept copy's token row at its place; zeros elsewhere (no gradient flows there).
    Backward: each token's K copies' rows gathered and summed."""
    return gather_rows(x_TD, plan.copy_of_row_R // top_k, plan.row_of_copy_N.view(-1, top_k),
                       plan.row_valid_R, plan.keep_N.view(-1, top_k))


def row_probs(probs_TK: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    """probs_R: the routing probability of each row's copy; 0 for padding and unused rows."""
    return torch.where(plan.row_valid_R, _index_rows(probs_TK.reshape(-1), plan.copy_of_row_R), 0)


def unpermute(y_RD: torch.Tensor, plan: PermutePlan, top_k: int) -> torch.Tensor:
    """y_TKD: each copy's expert output back in token order; zeros for dropped copies.

    A gather through `row_of_copy_N` (not a scatter-add); the mask keeps whatever the experts left
    in unused rows (even NaN) out of the result. Backward: a gather through `copy_of_row_R`.
    """
    y_ND = gather_rows(y_RD, plan.row_of_copy_N, plan.copy_of_row_R[:, None], plan.keep_N,
                       plan.row_valid_R[:, None])
    return y_ND.view(-1, top_k, y_RD.shape[-1])
