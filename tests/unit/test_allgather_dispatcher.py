"""AllGatherDispatcher (apply_ep(..., dispatcher="allgather")) against the single-process layer, on
gloo ranks, with the machinery of test_expert_parallel: same random configs, but the same token
count on every rank (all-gather dispatch needs it), and no host transfer at all.
"""

import dataclasses
import warnings

import pytest
import torch
from moe_reference import BACKENDS, build
from test_expert_parallel import _check_case as check_ep_case
from test_expert_parallel import (
    DIM,
    Case,
    _SyncingOps,
    random_case,
)
from test_parallel_dims import run_on_ranks

from moefold.config import MoEConfig
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.expert import apply_ep


def _even_case(seed: int, world: int) -> Case:
    case = random_case(seed, world, pad_multiples=(0, 0, 8))  # a third padded: PaddedBuffer
    return dataclasses.replace(case, tokens_per_rank=[case.tokens_per_rank[0]] * world)


def _check_case(rank: int, world: int, case: Case, ep_group) -> None:
    check_ep_case(rank, world, case, ep_group, dispatcher="allgather")


def _check_ranks(rank: int, world: int, cases: list[Case]) -> None:
    ep_group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    for case in cases:
        _check_case(rank, world, case, ep_group)
    # Uneven token counts: a clear error on every rank (CPU: the device-side assert raises at once).
    layer = build(MoEConfig(num_experts=world, top_k=1, expert_hidden=4, experts_backend="loop",
                            aux_loss_coeff=0.0), DIM, 0).float()
    apply_ep(layer, ep_group, dispatcher="allgather")
    with pytest.raises(RuntimeError, match="same number of tokens"):
        layer(torch.randn(1, 3 + rank, DIM))


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_ep_matches_single_process_layer(world):
    cases = [_even_case(world * 1000 + 10 + seed, world) for seed in range(6)]
    # These seeds cover both score functions, memory-efficient on and off, shared experts on and off,
    # padding and starved experts (top-k 1..4 over the two worlds); guard against generator changes.
    cfgs = [c.cfg for c in cases]
    assert {c.score_func for c in cfgs} == {"softmax", "sigmoid"}, cfgs
    assert {c.memory_efficient_permute for c in cfgs} == {True, False}, cfgs
    assert {c.shared_experts for c in cfgs} == {0, 1}, cfgs
    assert any(c.padding for c in cases) and any(c.starved for c in cases), cases
    run_on_ranks(_check_ranks, world, world, cases)


def test_apply_ep_rejects_unknown_dispatcher():
    layer = build(MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="loop"), DIM, 0)
    with pytest.raises(ValueError, match=r"dispatcher='ring', expected one of \['allgather', 'alltoall'\]"):
        apply_ep(layer, ep_group=None, dispatcher="ring")  # checked before any collective


def _count_host_transfers(rank: int, world: int) -> None:
    ep_group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="grouped_mm",
                    aux_loss_coeff=0.0, shared_experts=1)
    layer = build(cfg, DIM, 0).float()
    apply_ep(layer, ep_group, dispatcher="allgather")
    calls = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda t: calls.append(("tolist", t.shape)) or tolist(t)
    torch.Tensor.item = lambda t: calls.append(("item", t.shape)) or item(t)
    try:
        with _SyncingOps() as mode:
            y = layer(torch.randn(1, 6, DIM), torch.rand(1, 6) < 0.8)
            y.square().sum().backward()
    finally:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item
    assert calls == [], calls
    assert mode.seen == [], mode.seen


@pytest.mark.skipif("grouped_mm" not in BACKENDS, reason="the loop backend syncs by design")
def test_allgather_makes_no_host_transfer():
    run_on_ranks(_count_host_transfers, 2, 2)


def _dispatch_warnings(rank: int, world: int) -> None:
    ep_group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    layer = build(MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="loop",
                            aux_loss_coeff=0.0), DIM, 0).float()
    apply_ep(layer, ep_group, dispatcher="allgather")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(1, 6, DIM, requires_grad=True)).square().sum().backward()
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_allgather_dispatch_calls_no_deprecated_collective():
    """torch 2.13 deprecates the functional reduce_scatter_tensor_autograd: a FutureWarning on
    every MoE layer's combine, every step."""
    run_on_ranks(_dispatch_warnings, 2, 2)
