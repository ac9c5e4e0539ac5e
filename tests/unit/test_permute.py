"""The permutation's gathers and their gather-only backward against index_select's autograd (which
scatter-adds), with dropped copies, padded groups and pad-to-capacity layouts."""

import pytest
import torch

from moefold.moe.permute import RowLayout, gather_rows, permute, plan_permutation, unpermute

T, K, E, D = 37, 3, 5, 8


def _plan(seed: int, layout: RowLayout):
    gen = torch.Generator().manual_seed(seed)
    idx_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    keep_N = torch.rand(T * K, generator=gen) > 0.2  # some copies dropped
    return plan_permutation(idx_TK, keep_N, layout)


def _naive_permute(x_TD, plan):
    return torch.where(plan.row_valid_R[:, None], x_TD.index_select(0, plan.copy_of_row_R // K), 0)


def _naive_unpermute(y_RD, plan):
    y_ND = torch.where(plan.keep_N[:, None], y_RD.index_select(0, plan.row_of_copy_N), 0)
    return y_ND.view(-1, K, D)


# (capacity: every group padded to 30 rows, more than any expert gets here; drops over capacity are
# decided before the plan, by the capacity module)
LAYOUTS = {"dropless": dict(), "pad4": dict(pad_multiple=4), "capacity": dict(capacity_of=lambda t: 30)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_gathers_match_index_select_forward_and_backward(layout, dtype, seed):
    plan = _plan(seed, RowLayout(E, K, **LAYOUTS[layout]))
    x_TD = torch.randn(T, D, dtype=dtype, requires_grad=True)
    x_ref = x_TD.detach().clone().requires_grad_()
    x_RD, x_ref_RD = permute(x_TD, plan, K), _naive_permute(x_ref, plan)
    assert torch.equal(x_RD, x_ref_RD)
    w_RD = torch.randn_like(x_RD)
    y_TKD, y_ref_TKD = unpermute(x_RD * w_RD, plan, K), _naive_unpermute(x_ref_RD * w_RD, plan)
    assert torch.equal(y_TKD, y_ref_TKD)
    g_TKD = torch.randn_like(y_TKD)
    (y_TKD * g_TKD).sum().backward()
    (y_ref_TKD * g_TKD).sum().backward()
    # Sums of K copies in another order; in bf16 one fp32-accumulated reduction against K rounded adds.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x_TD.grad, x_ref.grad, **tol)
    assert x_TD.grad.dtype == dtype


def test_gather_rows_with_no_rows():
    """An expert-parallel rank may receive no rows at all."""
    src_XD = torch.randn(0, D, requires_grad=True)
    out_YD = gather_rows(src_XD, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64))
    out_YD.sum().backward()
    assert out_YD.shape == (0, D) and src_XD.grad.shape == (0, D)
