"""Expert-parallel dispatch (all-to-all, all-gather, pad-to-capacity all-to-all) under ep 2 and 4,
ep 2 of 4 ranks, ep 2 × etp 2 (both rank orders), etp 2 alone and EP folded over TP without
sequence parallelism, against one process and a per-token loop, on gloo ranks, at the edges: a rank
with no tokens, a rank whose tokens are all padding, every copy routed to one rank's experts, a
rank whose experts get no copy, top_k = num_experts, capacity drops, recompute, evaluation; then
the load counts and expert-bias update under EP, and the one-line refusals.

Every rank builds the same full layer (fp64, loop experts unless a case says otherwise). The
reference is the same layer in one process run on each group rank's tokens in turn (capacity is a
rank's own: it drops over its own tokens, as under data parallelism), and the per-token loop of
tests/moe_reference.py for the outputs. One backward of Σ_group ranks (y · upstream).sum() gives
the gradients: input rows as they are, router and shared weights all-reduced over the group,
expert weights as this rank's [experts, hidden] slice.
"""

import dataclasses
import re
import zlib

import pytest
import torch
import torch.distributed as dist
from moe_reference import build, reference_layer
from ranks import run_ranks

from moefold.config import MoEConfig
from moefold.memory.recompute import checkpointed
from moefold.moe.balance import DataParallelCounts
from moefold.parallel.dims import ParallelDims, ParallelLayout, expert_coords
from moefold.parallel.expert import apply_ep
from moefold.parallel.sequence import split_sequence_over_tp

DIM = 8
ORDER = "tp-cp-ep-dp-pp"  # the default rank order
TOL = dict(rtol=1e-5, atol=1e-6)  # fp64, but combine sums copies (and ranks) in fp32
TOLS = {torch.float64: TOL, torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}  # bf16: sums of different lengths round apart


@dataclasses.dataclass
class Case:
    name: str
    cfg: MoEConfig
    tokens: list[int]  # per group rank
    dispatcher: str = "alltoall"
    favour: list[int] | None = None  # experts whose router rows win every token (others starved)
    padded_rank: int | None = None  # this group rank's tokens are all padding
    dtype: torch.dtype = torch.float64
    recompute: bool = False  # the layer under memory.recompute's checkpoint (dispatch runs again in backward)


def _cfg(E: int, K: int, **kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=K, expert_hidden=4, aux_loss_coeff=0.0, router_dtype="fp64",
                experts_backend="loop", activation="swiglu", shared_experts=0)
    return MoEConfig(**(base | kw))


def _in_group(rank: int, world: int, ep: int, etp: int, order: str, cases: list[Case]) -> None:
    dist.init_process_group("gloo")
    dims = ParallelDims(world, ep=ep, etp=etp, order=order)
    layout = ParallelLayout(dims)
    group = layout.ep_etp_group
    members = dist.get_process_group_ranks(group)
    ep_of_rank = [expert_coords(dims, r)[2] for r in members]
    for case in cases:
        _check(case, group, members.index(rank), ep_of_rank, layout.expert_coords[3], etp)


def _layer(case: Case, seed: int):
    layer = build(case.cfg, DIM, seed).to(case.dtype)
    if case.favour is not None:
        with torch.no_grad():
            w = layer.router.weight
            w.abs_()
            others = [e for e in range(case.cfg.num_experts) if e not in case.favour]
            w[others] = -w[others] - 5.0  # inputs are positive: these experts never win
            w[case.favour] += 0.5
    return layer


def _inputs(case: Case, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    T = sum(case.tokens)
    x_TD = (torch.rand(T, DIM, generator=gen, dtype=torch.float64) + 0.1).to(case.dtype)
    upstream_TD = torch.randn(T, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
    valid_T = torch.ones(T, dtype=torch.bool)
    if case.padded_rank is not None:
        start = sum(case.tokens[:case.padded_rank])
        valid_T[start:start + case.tokens[case.padded_rank]] = False
    return x_TD, upstream_TD, valid_T



def _one_process_run(case: Case, ref, seed: int):
    """Every rank's inputs through the one-process layer `ref`, each rank's tokens a sequence of
    its own, forward and backward: (x_all, up_all, valid_all, each rank's rows, x_ref, y_ref)."""
    x_all, up_all, valid_all = _inputs(case, seed)
    ends = torch.tensor(case.tokens).cumsum(0).tolist()
    chunks = [slice(end - n, end) for n, end in zip(case.tokens, ends)]
    x_ref = x_all.clone().requires_grad_()
    y_ref = torch.cat([ref(x_ref[c][None], valid_all[c][None])[0] for c in chunks])
    if y_ref.requires_grad:  # not when no rank has a token
        (y_ref * up_all).sum().backward()
    return x_all, up_all, valid_all, chunks, x_ref, y_ref

def _check(case: Case, group, me: int, ep_of_rank: list[int], etp_rank: int, etp: int) -> None:
    seed = zlib.crc32(case.name.encode()) % 10_000
    note = f"group rank {me}, case {case.name}"
    ref, layer = _layer(case, seed), _layer(case, seed)
    apply_ep(layer, group, case.dispatcher, ep_of_rank, etp_rank, etp)

    x_all, up_all, valid_all, chunks, x_ref, y_ref = _one_process_run(case, ref, seed)

    mine = chunks[me]
    x = x_all[mine].clone().requires_grad_()
    run = checkpointed(layer, [layer]) if case.recompute else layer
    y = run(x[None], valid_all[mine][None])[0]
    (y * up_all[mine]).sum().backward()
    with torch.no_grad():  # evaluation (validation): no graph, the same outputs
        y_eval = layer.eval()(x_all[mine][None], valid_all[mine][None])[0]
        y_ref_eval = ref.eval()(x_all[mine][None], valid_all[mine][None])[0]

    tol = TOLS[case.dtype]
    if case.padded_rank is None and case.tokens[me] and case.dtype != torch.bfloat16:  # the loop
        # knows no padding, no T = 0, and is fp64
        with torch.no_grad():
            y_loop = reference_layer(x_all[mine].double(), ref.double(), case.cfg).to(case.dtype)
        ref.to(case.dtype)
        # combine sums the K copies in fp32 (moe/dispatch.py), so the loop agrees to fp32's precision
        torch.testing.assert_close(y.detach(), y_loop, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"output vs loop: {m}\n{note}")
    torch.testing.assert_close(y.detach(), y_ref[mine].detach(), **tol, msg=lambda m: f"output: {m}\n{note}")
    torch.testing.assert_close(y_eval, y_ref_eval, **tol, msg=lambda m: f"eval output: {m}\n{note}")
    grad_x = _grad(x)
    torch.testing.assert_close(grad_x, _grad(x_ref)[mine], **tol, msg=lambda m: f"x grad: {m}\n{note}")
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            continue
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, _grad(ref_params[name]), **tol,
                                   msg=lambda m, name=name: f"{name} grad (all-reduced): {m}\n{note}")
    L, ep_rank = case.cfg.num_experts // len(set(ep_of_rank)), ep_of_rank[me]
    F = case.cfg.expert_hidden // etp
    f = slice(etp_rank * F, (etp_rank + 1) * F)
    index = {"w1_EDF": (slice(None), slice(None), f), "w3_EDF": (slice(None), slice(None), f),
             "w2_EFD": (slice(None), f)}
    for name, p in layer.experts.named_parameters():
        full = ref_params[f"experts.{name}"]
        want = _grad(full)[ep_rank * L:(ep_rank + 1) * L][index[name]]
        got = _grad(p)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name} grad: {m}\n{note}")
        for e in range(L) if case.favour is not None else ():  # starved experts: exact zeros
            if ep_rank * L + e not in case.favour:
                assert not got[e].any(), f"{name} grad of starved expert {ep_rank * L + e}\n{note}"


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _cases(group_size: int, dispatchers: tuple[str, ...]) -> list[Case]:
    P = group_size
    cases = []
    for d in dispatchers:
        even = d != "alltoall"  # all-gather needs the same T on every rank
        t = lambda uneven: [5] * P if even else uneven  # noqa: E731
        cases += [
            Case(f"{d}-one-rank-experts", _cfg(2 * P, 2), t([3, 7] + [4] * (P - 2)), d, favour=[0, 1]),
            Case(f"{d}-last-rank-starved", _cfg(2 * P, 2), t([5, 2] + [6] * (P - 2)), d,
                 favour=list(range(2 * P - 2))),
            Case(f"{d}-topk-all", _cfg(P, P, activation="gelu", memory_efficient_permute=False),
                 t([4, 1] + [3] * (P - 2)), d),
            Case(f"{d}-padded-rank", _cfg(2 * P, 3, pad_multiple=8), t([4, 6] + [2] * (P - 2)), d,
                 padded_rank=0),
            Case(f"{d}-capacity-probs", _cfg(2 * P, 2, capacity_factor=0.5, drop_policy="probs"),
                 t([7, 3] + [9] * (P - 2)), d, favour=[1, 2, 3]),
            Case(f"{d}-capacity-position-topk-all",
                 _cfg(P, P, capacity_factor=0.75, drop_policy="position", pad_multiple=8),
                 t([6, 5] + [7] * (P - 2)), d),
            Case(f"{d}-grouped-mm-fp32",
                 _cfg(2 * P, 2, experts_backend="grouped_mm", shared_experts=1, expert_hidden=8),
                 t([3, 8] + [5] * (P - 2)), d, dtype=torch.float32),
            Case(f"{d}-grouped-mm-padded-starved", _cfg(2 * P, 2, experts_backend="grouped_mm", expert_hidden=8,
                                                        pad_multiple=8, memory_efficient_permute=False),
                 t([2, 6] + [3] * (P - 2)), d, favour=[0, 2], dtype=torch.float32),
            Case(f"{d}-bf16", _cfg(2 * P, 2, pad_multiple=8), t([4, 6] + [5] * (P - 2)), d, dtype=torch.bfloat16),
            Case(f"{d}-recompute-capacity", _cfg(2 * P, 3, capacity_factor=1.0, activation="relu2",
                                                 memory_efficient_permute=False),
                 t([6, 3] + [4] * (P - 2)), d, recompute=True),
        ]
        if d == "alltoall":
            cases.append(Case(f"{d}-empty-rank", _cfg(2 * P, 2), [0, 5] + [3] * (P - 2), d))
            cases.append(Case(f"{d}-empty-rank-padded-groups", _cfg(2 * P, 2, pad_multiple=8),
                              [4, 0] + [0] * (P - 2), d))
    for d in dispatchers:  # every rank empty: the same T (0) everywhere, as all-gather needs
        cases.append(Case(f"{d}-all-empty", _cfg(2 * P, 2, pad_multiple=8), [0] * P, d))
    cases.append(Case("capacity-a2a-all-empty", _cfg(2 * P, 2, capacity_factor=1.0, pad_to_capacity=True),
                      [0] * P, "alltoall"))
    for pad in (0, 8):  # pad-to-capacity: the same T on every rank
        cfg = _cfg(2 * P, 2, capacity_factor=0.5, drop_policy="probs", pad_to_capacity=True, pad_multiple=pad)
        cases.append(Case(f"capacity-a2a-pad{pad}", cfg, [6] * P, "alltoall", favour=[0, 1, 2]))
    cases.append(Case("capacity-a2a-topk-all", _cfg(P, P, capacity_factor=1.0, pad_to_capacity=True,
                                                    drop_policy="position"), [4] * P, "alltoall"))
    return cases


@pytest.mark.parametrize("world,ep,etp,order", [(2, 2, 1, ORDER), (4, 4, 1, ORDER), (4, 2, 1, ORDER),
                                                (4, 2, 2, ORDER), (4, 2, 2, "ep-tp-cp-dp-pp"), (2, 1, 2, ORDER)],
                         ids=["ep2", "ep4", "ep2-of-4", "ep2-etp2", "ep2-etp2-ep-fastest", "etp2-only"])
def test_dispatchers_match_one_process_at_the_edges(world, ep, etp, order):
    """ep-fastest order: the EP×ETP group's ranks alternate EP indices (0, 1, 0, 1)."""
    run_ranks(world, _in_group, world, ep, etp, order, _cases(ep * etp, ("alltoall", "allgather")))


# ---------------------------------------------------------------------------------------------
# EP folded over TP without sequence parallelism: every TP rank holds its data rank's tokens whole
# and dispatches 1/tp of them (SequenceSplitDispatcher around the EP dispatcher)
# ---------------------------------------------------------------------------------------------


def _tp_split_ranks(rank: int, world: int, sizes: dict, cases: list[Case]) -> None:
    dist.init_process_group("gloo")
    dims = ParallelDims(world, **sizes)
    layout = ParallelLayout(dims)
    members = dist.get_process_group_ranks(layout.ep_etp_group)
    ep_of_rank = [expert_coords(dims, r)[2] for r in members]
    for case in cases:
        _check_tp_split(case, layout, ep_of_rank, dims.etp)


def _check_tp_split(case: Case, layout, ep_of_rank: list[int], etp: int) -> None:
    """Case.tokens: per data rank. Replicated computation over TP: every TP rank's output and
    input gradient are its data rank's whole ones; router gradients sum over the data ranks,
    expert gradients over the expert-data ranks."""
    seed = zlib.crc32(case.name.encode()) % 10_000
    dp_rank, etp_rank = layout.attention_coords[1], layout.expert_coords[3]
    note = f"rank {dist.get_rank()}, case {case.name}"
    ref, layer = _layer(case, seed), _layer(case, seed)
    apply_ep(layer, layout.ep_etp_group, case.dispatcher, ep_of_rank, etp_rank, etp)
    split_sequence_over_tp(layer, layout.tp_group)

    x_all, up_all, valid_all, chunks, x_ref, y_ref = _one_process_run(case, ref, seed)

    mine = chunks[dp_rank]
    x = x_all[mine].clone().requires_grad_()
    y = layer(x[None], valid_all[mine][None])[0]
    (y * up_all[mine]).sum().backward()
    with torch.no_grad():
        y_eval = layer.eval()(x_all[mine][None], valid_all[mine][None])[0]

    torch.testing.assert_close(y.detach(), y_ref[mine].detach(), **TOL, msg=lambda m: f"output: {m}\n{note}")
    torch.testing.assert_close(y_eval, y_ref[mine].detach(), **TOL, msg=lambda m: f"eval output: {m}\n{note}")
    torch.testing.assert_close(_grad(x), _grad(x_ref)[mine], **TOL, msg=lambda m: f"x grad: {m}\n{note}")
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        grad = _grad(p).clone()
        if name.startswith("experts."):
            dist.all_reduce(grad, group=layout.edp_group)
            L, ep_rank = case.cfg.num_experts // len(set(ep_of_rank)), layout.expert_coords[2]
            F = case.cfg.expert_hidden // etp
            f = slice(etp_rank * F, (etp_rank + 1) * F)
            want = _grad(ref_params[name])[ep_rank * L:(ep_rank + 1) * L]
            want = want[:, :, f] if name != "experts.w2_EFD" else want[:, f]
        else:
            dist.all_reduce(grad, group=layout.dp_group)
            want = _grad(ref_params[name])
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m, name=name: f"{name} grad: {m}\n{note}")


def _tp_split_cases(dp: int) -> list[Case]:
    T = [6] * dp  # T divides by tp; the same on every data rank for the static-shape dispatchers
    cases = []
    for d in ("alltoall", "allgather"):
        cases += [Case(f"tp-{d}", _cfg(4, 2, shared_experts=1), T, d, favour=[0, 1]),
                  Case(f"tp-{d}-capacity", _cfg(4, 2, capacity_factor=0.5, pad_multiple=8), T, d,
                       favour=[1, 2, 3]),
                  Case(f"tp-{d}-padded", _cfg(4, 4, memory_efficient_permute=False), T, d, padded_rank=0)]
    for d in ("alltoall", "allgather"):  # no tokens at all (an empty batch): T = 0 splits too
        cases.append(Case(f"tp-{d}-empty", _cfg(4, 2), [0] * dp, d))
    cases.append(Case("tp-capacity-a2a", _cfg(4, 2, capacity_factor=0.75, pad_to_capacity=True), T,
                      "alltoall", favour=[0, 1, 2]))
    return cases


@pytest.mark.parametrize("world,sizes", [(2, dict(tp=2, ep=2)), (4, dict(tp=2, ep=4)),
                                         (4, dict(tp=2, ep=2, etp=2))],
                         ids=["tp2-ep2", "tp2-ep4", "tp2-ep2-etp2"])
def test_ep_folded_over_tp_without_sequence_parallelism_matches_one_process(world, sizes):
    dp = world // sizes["tp"]
    run_ranks(world, _tp_split_ranks, world, sizes, _tp_split_cases(dp))


# ---------------------------------------------------------------------------------------------
# apply_ep's arguments that cannot describe a layout: one-line errors, not wrong outputs
# ---------------------------------------------------------------------------------------------


def _refusals(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    make = lambda: build(_cfg(4, 2), DIM, 0)  # noqa: E731
    # A hidden slice (etp 2) with every group rank its own EP index: half of each expert, silently.
    with pytest.raises(ValueError, match=r"^apply_ep: .*etp_size=2.*ep_of_rank"):
        apply_ep(make(), group, etp_rank=rank % 2, etp_size=2)
    with pytest.raises(ValueError, match=r"^apply_ep: .*ep_of_rank"):  # not one EP index per group rank
        apply_ep(make(), group, ep_of_rank=[0] * (world + 1))
    with pytest.raises(ValueError, match=r"^apply_ep: .*etp_rank=2"):
        apply_ep(make(), group, ep_of_rank=[0, 0], etp_rank=2, etp_size=2)


def test_apply_ep_refuses_arguments_that_describe_no_layout_in_one_line():
    run_ranks(2, _refusals, 2)


# ---------------------------------------------------------------------------------------------
# Load counts, dropped copies and the expert-bias update under EP: the global batch's
# ---------------------------------------------------------------------------------------------


def _counts_ranks(rank: int, world: int, dispatcher: str) -> None:
    dist.init_process_group("gloo")
    group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    cfg = _cfg(2 * world, 2, expert_bias=True, expert_bias_update_rate=0.1, capacity_factor=0.75,
               score_func="sigmoid")
    tokens = [5] * world if dispatcher == "allgather" else [3, 0, 7, 4][:world]
    case = Case("counts", cfg, tokens, dispatcher, padded_rank=world - 1, favour=[0, 1, 2])
    ref, layer = _layer(case, 7), _layer(case, 7)
    apply_ep(layer, group, dispatcher)
    layer.count_routed = DataParallelCounts(group)  # as parallelize sets it (dp = world here)
    x_all, _, valid_all = _inputs(case, 7)
    ends = torch.tensor(tokens).cumsum(0).tolist()
    chunks = [slice(end - n, end) for n, end in zip(tokens, ends)]
    for run in (layer, checkpointed(layer, [layer])):  # two micro-batches (one recomputed in
        for c in chunks:                                 # backward: counted once), then the update
            ref(x_all[c][None], valid_all[c][None])
        run(x_all[chunks[rank]][None].requires_grad_(), valid_all[chunks[rank]][None]).sum().backward()
    want, got = ref.stats.pop(), layer.stats.pop()
    for key in ("tokens_per_expert_E", "dropped"):
        torch.testing.assert_close(got[key], want[key], msg=lambda m, key=key: f"{key}: {m}")
    assert want["dropped"] > 0
    ref.on_optimizer_step()
    layer.on_optimizer_step()
    torch.testing.assert_close(layer.router.expert_bias_E, ref.router.expert_bias_E, rtol=0, atol=0)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_load_counts_and_expert_bias_under_ep_are_the_global_batch_s(dispatcher):
    run_ranks(4, _counts_ranks, 4, dispatcher)


def _uneven_tokens(rank: int, world: int) -> None:
    """The static-shape dispatchers refuse different token counts on the ranks of a group in one
    line that names the option to change."""
    dist.init_process_group("gloo")
    group = ParallelLayout(ParallelDims(world, ep=world)).ep_group
    for dispatcher, cfg, option in [
            ("allgather", _cfg(4, 2), "parallel.ep_dispatcher='alltoall'"),
            ("alltoall", _cfg(4, 2, capacity_factor=1.0, pad_to_capacity=True), "moe.pad_to_capacity=false")]:
        layer = build(cfg, DIM, 0)
        apply_ep(layer, group, dispatcher)
        message = r"same number of tokens .*this rank has [23] .*" + re.escape(option)
        with pytest.raises(RuntimeError, match=message):
            layer(torch.rand(1, 2 + rank, DIM, dtype=torch.float64))


def test_static_shape_dispatchers_refuse_uneven_tokens_naming_the_option():
    run_ranks(2, _uneven_tokens, 2)
