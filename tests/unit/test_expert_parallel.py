"""Expert parallelism (AllToAllDispatcher, apply_ep) against the single-process layer, on gloo ranks.

Every rank builds the same full layer (same seed) and keeps a copy as the reference; the EP layer
runs only this rank's tokens. The reference runs all ranks' tokens concatenated, so one backward of
loss = Σ_ranks (y · upstream).sum() gives the input, router, shared and expert gradients the EP
ranks must reproduce (router and shared gradients after a SUM all-reduce over the EP group; expert
gradients as the slice of this rank's experts).
"""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from moe_reference import BACKENDS, build, without_inert_options
from test_parallel_dims import run_on_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.config import MoEConfig
from moefold.errors import ConfigError
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.expert import DISPATCHERS, AllToAllDispatcher, CapacityAllToAllDispatcher, apply_ep

DIM = 8
TOL = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class Case:
    cfg: MoEConfig
    seed: int
    tokens_per_rank: list[int]
    starved: list[int]  # experts that never win (no tokens anywhere)
    padding: bool  # some tokens are padding (valid=False); rank 0 all padding when tokens are few


def random_case(seed: int, world: int, pad_multiples: tuple[int, ...] = (0,), capacity: bool = False) -> Case:
    """A random layer and batch; with `capacity`, a capacity factor (over or under the even share),
    a drop policy and, half the time, every expert padded to its capacity (the same T on every
    rank, as that dispatcher needs)."""
    rng = random.Random(seed)
    E = world * rng.choice([1, 2, 3])
    L = E // world
    cfg = MoEConfig(num_experts=E, top_k=rng.randint(1, min(4, E)), expert_hidden=rng.choice([4, 8]),
                    score_func=rng.choice(["softmax", "sigmoid"]), norm_topk_prob=rng.random() < 0.5,
                    routed_scaling_factor=rng.choice([1.0, 2.5]), aux_loss_coeff=0.0,
                    activation=rng.choice(["swiglu", "gelu", "relu2"]),
                    memory_efficient_permute=rng.random() < 0.5, shared_experts=rng.choice([0, 1]),
                    shared_expert_gate=rng.random() < 0.5, router_dtype="fp32",
                    experts_backend=rng.choice(BACKENDS),
                    pad_multiple=random.Random(-seed).choice(pad_multiples))
    if cfg.score_func == "softmax":
        cfg.softmax_before_topk = rng.random() < 0.7
    # Starve a few experts (or all of the last rank's, so that rank receives no rows at all) while
    # leaving at least top_k experts that can win.
    if E - L >= cfg.top_k and rng.random() < 0.4:
        starved = list(range(E - L, E))
    else:
        starved = rng.sample(range(E), rng.randint(0, E - cfg.top_k))
    tokens = [rng.randint(1, 9) for _ in range(world)]  # uneven token counts per rank
    if capacity:
        cfg.capacity_factor = rng.choice([0.5, 1.0, 1.5])
        cfg.drop_policy = rng.choice(["probs", "position"])
        cfg.pad_to_capacity = rng.random() < 0.5
        if cfg.pad_to_capacity:
            tokens = [tokens[0]] * world
    return Case(without_inert_options(cfg), seed, tokens, starved, padding=rng.random() < 0.3)


def _inputs(case: Case, world: int):
    gen = torch.Generator().manual_seed(case.seed)
    T = sum(case.tokens_per_rank)
    x_TD = torch.rand(T, DIM, generator=gen) + 0.1  # positive, so negative router rows never win
    upstream_TD = torch.randn(T, DIM, generator=gen)
    valid_T = torch.ones(T, dtype=torch.bool)
    if case.padding:
        valid_T = torch.rand(T, generator=gen) < 0.7
        valid_T[:case.tokens_per_rank[0]] = False  # rank 0 sends nothing
    return x_TD, upstream_TD, valid_T


def _build(case: Case):
    layer = build(case.cfg, DIM, case.seed).float()
    with torch.no_grad():
        for e in case.starved:
            layer.router.weight[e] = -5.0 - e
    return layer


def _check_case(rank: int, world: int, case: Case, ep_group, dispatcher: str = "alltoall") -> None:
    note = f"rank {rank}, {dispatcher}, case {case}"
    ref, layer = _build(case), _build(case)
    apply_ep(layer, ep_group, dispatcher=dispatcher)
    expected = CapacityAllToAllDispatcher if case.cfg.pad_to_capacity else DISPATCHERS[dispatcher]
    assert type(layer.dispatcher) is expected, note

    x_all, upstream_all, valid_all = _inputs(case, world)
    x_ref = x_all.clone().requires_grad_()
    # Each rank's tokens through the reference on their own: a rank's capacity is that of its own
    # tokens (as under data parallelism); without one, the same as all tokens in one call.
    ends = torch.tensor(case.tokens_per_rank).cumsum(0).tolist()
    chunks = [slice(end - n, end) for n, end in zip(case.tokens_per_rank, ends)]
    y_ref = torch.cat([ref(x_ref[c][None], valid_all[c][None])[0] for c in chunks])
    (y_ref * upstream_all).sum().backward()

    mine = chunks[rank]
    x = x_all[mine].clone().requires_grad_()
    y = layer(x[None], valid_all[mine][None])[0]
    (y * upstream_all[mine]).sum().backward()

    torch.testing.assert_close(y, y_ref[mine].detach(), **TOL, msg=lambda m: f"output: {m}\n{note}")
    torch.testing.assert_close(x.grad, x_ref.grad[mine], **TOL, msg=lambda m: f"x grad: {m}\n{note}")
    replicated = [(n, p) for n, p in layer.named_parameters() if not n.startswith("experts.")]
    ref_params = dict(ref.named_parameters())
    for name, p in replicated:
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=ep_group)
        torch.testing.assert_close(grad, ref_params[name].grad, **TOL,
                                   msg=lambda m, name=name: f"{name} grad (all-reduced): {m}\n{note}")
    L = case.cfg.num_experts // world
    assert layer.experts.num_experts == L
    for name, p in layer.experts.named_parameters():
        expected = ref_params[f"experts.{name}"].grad[rank * L:(rank + 1) * L]
        torch.testing.assert_close(p, ref_params[f"experts.{name}"][rank * L:(rank + 1) * L])
        torch.testing.assert_close(p.grad, expected, **TOL,
                                   msg=lambda m, name=name: f"{name} grad: {m}\n{note}")
    for e in case.starved:  # experts without tokens get exact zero gradients
        if e // L == rank:
            assert layer.experts.w2_EFD.grad[e % L].abs().sum() == 0, note


def _check_ranks(rank: int, world: int, cases: list[Case]) -> None:
    ep_group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    for case in cases:
        _check_case(rank, world, case, ep_group)
    with pytest.raises(ConfigError, match="does not divide moe.num_experts"):
        apply_ep(build(MoEConfig(num_experts=world + 1, top_k=1, expert_hidden=4,
                                 experts_backend="loop"), DIM, 0), ep_group)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_single_process_layer(world):
    # a third of the cases pad each expert's rows to 8 (as FP8 experts need): PaddedRegroup
    cases = [random_case(world * 1000 + seed, world, pad_multiples=(0, 0, 8)) for seed in range(12)]
    run_on_ranks(_check_ranks, world, world, cases)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_with_capacity_matches_single_process_layer_on_each_rank_s_tokens(world):
    """Capacity factors over and under the even share, both drop policies, with and without every
    expert padded to its capacity (CapacityAllToAllDispatcher) and to a multiple of 8 on top."""
    cases = [random_case(world * 2000 + seed, world, pad_multiples=(0, 0, 8), capacity=True)
             for seed in range(12)]
    assert {c.cfg.pad_to_capacity for c in cases} == {False, True}
    run_on_ranks(_check_ranks, world, world, cases)


def test_pad_to_capacity_needs_the_all_to_all_dispatcher():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="loop", capacity_factor=1.25,
                    pad_to_capacity=True)
    with pytest.raises(ConfigError, match=r"moe.pad_to_capacity=true under parallel.ep·etp > 1 needs "
                                          r"parallel.ep_dispatcher='alltoall', not 'allgather'"):
        apply_ep(build(cfg, DIM, 0), ep_group=None, dispatcher="allgather")  # before any collective


def test_apply_ep_twice_is_an_error():
    layer = build(MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="loop"), DIM, 0)
    layer.dispatcher = object.__new__(AllToAllDispatcher)
    with pytest.raises(ValueError, match="expected LocalDispatcher"):
        apply_ep(layer, ep_group=None)


class _SyncingOps(TorchDispatchMode):
    """Records the ops that would make the host wait for the device (item, nonzero, and
    repeat_interleave without output_size)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero") or (
                name == "repeat_interleave" and kwargs.get("output_size") is None):
            self.seen.append(name)
        return func(*args, **kwargs)


def _count_host_syncs(rank: int, world: int, pad_to_capacity: bool) -> None:
    ep_group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=4, experts_backend="grouped_mm",
                    aux_loss_coeff=0.0)
    if pad_to_capacity:
        cfg = dataclasses.replace(cfg, capacity_factor=1.0, pad_to_capacity=True)
    layer = build(cfg, DIM, 0).float()
    apply_ep(layer, ep_group)
    calls = []
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: calls.append(t.shape) or tolist(t)  # .tolist() dispatches no op
    try:
        with _SyncingOps() as mode:
            y = layer(torch.randn(1, 6 if pad_to_capacity else 6 + rank, DIM))
            calls_forward = len(calls)
            y.square().sum().backward()
    finally:
        torch.Tensor.tolist = tolist
    if pad_to_capacity:  # equal splits: nothing to read back
        assert calls == [], calls
    else:
        assert calls_forward == 1 and calls == [torch.Size([2 * world])], calls  # the split sizes
    assert mode.seen == [], mode.seen


@pytest.mark.skipif("grouped_mm" not in BACKENDS, reason="the loop backend syncs by design")
@pytest.mark.parametrize("pad_to_capacity", [False, True], ids=["dropless", "pad-to-capacity"])
def test_host_transfers_per_layer_call(pad_to_capacity):
    """One device→host copy a layer call (the split sizes) for the dropless all-to-all; none when
    every expert is padded to its capacity."""
    run_on_ranks(_count_host_syncs, 2, 2, pad_to_capacity)
