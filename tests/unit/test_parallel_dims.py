"""Parallel folding: the rank arithmetic of ParallelDims against a naive enumeration, its checks,
and ParallelLayout's process groups on 4 gloo ranks."""

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.parallel.dims import (
    GROUPS,
    ParallelDims,
    ParallelLayout,
    _groups,
    attention_coords,
    attention_mesh,
    expert_coords,
    expert_mesh,
    group_ranks,
    rank_grid,
)

# (world, tp, cp, pp, ep, etp) in the default order tp-cp-ep-dp-pp.
LAYOUTS = [
    (8, 2, 2, 1, 8, 1),   # attention TP2·CP2·DP2, experts EP8: EP folds across TP×CP×DP
    (8, 2, 1, 1, 4, 1),   # tp2 dp4 | ep4 edp2
    (4, 2, 1, 1, 2, 2),   # tp2 dp2 | etp2 ep2 edp1
    (16, 2, 1, 2, 4, 1),  # two pipeline stages
    (24, 2, 3, 2, 2, 3),  # odd sizes, edp2, dp2
    (8, 1, 1, 1, 1, 1),   # pure data parallel
    (1, 1, 1, 1, 1, 1),
]


def naive_coords(world, tp, cp, pp, ep, etp):
    """Each rank's attention (pp, dp, cp, tp) and expert (pp, edp, ep, etp) coordinates, read
    straight off the default order: tp varies fastest, then cp, dp, pp; etp, then ep, edp, pp."""
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    att = {r: (r // (tp * cp * dp), r // (tp * cp) % dp, r // tp % cp, r % tp)
           for r in range(world)}
    exp = {r: (r // (etp * ep * edp), r // (etp * ep) % edp, r // etp % ep, r % etp)
           for r in range(world)}
    return att, exp


def naive_groups(coords, span_idx):
    """Sets of ranks that agree on every coordinate outside `span_idx`."""
    groups = {}
    for rank, c in coords.items():
        key = tuple(x for i, x in enumerate(c) if i not in span_idx)
        groups.setdefault(key, set()).add(rank)
    return {frozenset(g) for g in groups.values()}


SPAN_IDX = {"tp": (3,), "cp": (2,), "dp": (1,), "dp_cp": (1, 2), "pp": (0,),
            "ep": (2,), "etp": (3,), "edp": (1,), "ep_etp": (2, 3)}


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_grids_match_naive_enumeration(world, tp, cp, pp, ep, etp):
    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    assert dims.dp == world // (tp * cp * pp) and dims.edp == world // (etp * ep * pp)
    att, exp = naive_coords(world, tp, cp, pp, ep, etp)
    for rank in range(world):
        assert attention_coords(dims, rank) == att[rank]
        assert expert_coords(dims, rank) == exp[rank]
        pp_, dp_, cp_, tp_ = att[rank]
        assert attention_mesh(dims)[pp_][dp_][cp_][tp_] == rank
        pp_, edp_, ep_, etp_ = exp[rank]
        assert expert_mesh(dims)[pp_][edp_][ep_][etp_] == rank
    for name, (grid, _) in GROUPS.items():
        coords = att if grid == "attention" else exp
        groups = group_ranks(dims, name)
        assert {frozenset(g) for g in groups} == naive_groups(coords, SPAN_IDX[name]), name
        # as DeviceMesh lists them: each group in grid order, the groups by their first rank
        assert all(g == sorted(g, key=coords.__getitem__) for g in groups), name
        assert [g[0] for g in groups] == sorted(min(g) for g in groups), name
        # every group kind partitions the ranks
        assert sorted(itertools.chain(*groups)) == list(range(world)), name
        assert len({len(g) for g in groups}) == 1, name


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_pipeline_stages_hold_the_same_ranks_in_both_layouts(world, tp, cp, pp, ep, etp):
    dims = ParallelDims(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    for stage in range(pp):
        attention = set(itertools.chain.from_iterable(
            itertools.chain.from_iterable(attention_mesh(dims)[stage])))
        experts = set(itertools.chain.from_iterable(
            itertools.chain.from_iterable(expert_mesh(dims)[stage])))
        assert attention == experts


def test_ep_folds_across_tp_cp_dp():
    dims = ParallelDims(8, tp=2, cp=2, ep=8)
    assert group_ranks(dims, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(dims, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(dims, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(dims, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert group_ranks(dims, "ep") == [list(range(8))]
    assert group_ranks(dims, "edp") == [[r] for r in range(8)]


def test_expert_tensor_parallel_layout():
    dims = ParallelDims(4, tp=2, ep=2, etp=2)
    assert group_ranks(dims, "etp") == [[0, 1], [2, 3]]
    assert group_ranks(dims, "ep") == [[0, 2], [1, 3]]
    assert group_ranks(dims, "ep_etp") == [[0, 1, 2, 3]]
    assert dims.edp == 1


def test_order_changes_which_dim_varies_fastest():
    dims = ParallelDims(8, tp=2, cp=2, ep=2, order="tp-dp-cp-ep-pp")
    assert group_ranks(dims, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(dims, "cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # experts read the same order with cp=1: etp(1), edp(4), ep(2)
    assert group_ranks(dims, "ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs,message", [
    (dict(world=6, tp=2, cp=2),
     "parallel: world size 6 is not divisible by tp·cp·pp = 4 (tp=2, cp=2, pp=1)"),
    (dict(world=8, ep=3),
     "parallel: world size 8 is not divisible by etp·ep·pp = 3 (etp=1, ep=3, pp=1)"),
    (dict(world=8, tp=0), "parallel.tp=0 must be >= 1"),
    (dict(world=0), "parallel: world size 0 must be >= 1"),
    (dict(world=8, order="tp-cp-dp-pp"),
     ("parallel.order='tp-cp-dp-pp' must name each of tp, cp, ep, dp, pp once, joined by '-' "
      "(default tp-cp-ep-dp-pp)")),
    (dict(world=8, tp=2, pp=2, ep=4, order="tp-pp-cp-ep-dp"),
     ("parallel.order='tp-pp-cp-ep-dp' gives attention and experts different pipeline stages: the "
      "sizes before pp group attention's ranks by tp = 2 and the experts' by etp = 1; put pp last (or first)")),
])
def test_size_errors(kwargs, message):
    with pytest.raises(ConfigError) as e:
        ParallelDims(**kwargs)
    assert str(e.value) == message


def _unchecked(**sizes) -> ParallelDims:
    """A ParallelDims built without __post_init__'s checks, to enumerate a layout they refuse."""
    dims = object.__new__(ParallelDims)
    for name, value in {"order": "tp-cp-ep-dp-pp", **sizes}.items():
        object.__setattr__(dims, name, value)
    return dims


def test_pipeline_stage_check_agrees_with_enumerating_both_grids():
    """The constant-time check (equal strides before pp in the order) against the pp groups of
    the two grids enumerated rank by rank, for every order and small sizes."""
    refused = 0
    for order in map("-".join, itertools.permutations(["tp", "cp", "ep", "dp", "pp"])):
        for tp, cp, pp, ep, etp in itertools.product([1, 2, 3], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2]):
            world = 2 * math.lcm(tp * cp * pp, etp * ep * pp)
            dims = _unchecked(world=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
            same = group_ranks(dims, "pp") == _groups(dims, "expert", ("pp",))
            try:
                ParallelDims(world, tp, cp, pp, ep, etp, order)
                accepted = True
            except ConfigError as error:
                assert "different pipeline stages" in str(error)
                assert _named_strides(str(error)) == _pp_group_spacings(dims), (order, str(error))
                accepted = False
            assert accepted == same, (order, world, tp, cp, pp, ep, etp)
            refused += not accepted
    assert refused > 1000  # the check refuses a good share of these layouts, not none


def _named_strides(message: str) -> tuple[int, int]:
    """The attention and expert strides the pipeline-stage refusal names ('by tp·cp = 2')."""
    attention, experts = re.findall(r"by [a-z·]+ = (\d+)", message)
    return int(attention), int(experts)


def _pp_group_spacings(dims: ParallelDims) -> tuple[int, int]:
    """How far apart rank 0's pipeline group's first two ranks are in each grid, enumerated."""
    attention, = (g for g in group_ranks(dims, "pp") if 0 in g)
    experts, = (g for g in _groups(dims, "expert", ("pp",)) if 0 in g)
    return attention[1] - attention[0], experts[1] - experts[0]


def test_huge_sizes_are_refused_by_the_model_not_enumerated():
    """parallel.tp=1e8 is one line about model.n_heads, not a walk over 1e8 ranks."""
    with pytest.raises(ConfigError, match="parallel.tp=100000000 does not divide model.n_heads=4"):
        load_config("tiny", {"parallel.tp": "100000000"})


def test_smallest_world_fits_both_grids():
    assert ParallelDims.smallest(tp=2, cp=2, ep=8).world == 8
    assert ParallelDims.smallest(tp=4, ep=6, pp=2).world == 24
    assert ParallelDims.smallest().world == 1
    with pytest.raises(ConfigError, match=r"^parallel.ep=0 must be >= 1$"):
        ParallelDims.smallest(tp=2, ep=0)


MODEL = dict(num_experts=8, n_heads=4, n_kv_heads=2, n_layers=4, seq_len=32)


@pytest.mark.parametrize("sizes,model,message", [
    (dict(ep=3), dict(num_experts=9), None),
    (dict(ep=4), dict(num_experts=6), "parallel.ep=4 does not divide moe.num_experts=6"),
    (dict(ep=2), dict(num_experts=0),
     ("parallel.ep=2, parallel.etp=1 need routed experts "
      "(moe.num_experts=0 makes every layer dense)")),
    (dict(etp=2), dict(expert_hidden=33), "parallel.etp=2 does not divide moe.expert_hidden=33"),
    (dict(tp=3), dict(n_heads=4, n_kv_heads=1),
     "parallel.tp=3 does not divide model.n_heads=4 (each TP rank holds whole query heads)"),
    (dict(tp=4), {},
     "parallel.tp=4 does not divide model.n_kv_heads=2 (each TP rank holds whole key/value heads)"),
    (dict(tp=4), dict(n_kv_heads=0), None),  # 0 means n_heads=4
    (dict(cp=2), dict(seq_len=30), "parallel.cp=2 needs train.seq_len=30 divisible by 2·cp = 4"),
    (dict(cp=1), dict(seq_len=31), None),  # no CP: any length
    (dict(pp=8), {},
     "parallel.pp=8 exceeds model.n_layers=4 (every pipeline stage needs at least one layer)"),
    (dict(tp=2), dict(ffn_hidden=99),
     "parallel.tp=2 does not divide model.ffn_hidden=99 (the dense MLP's hidden units split evenly over the TP ranks)"),
    (dict(tp=2), dict(shared_hidden=33),
     "parallel.tp=2 does not divide the shared experts' hidden size 33 (moe.shared_experts · "
     "moe.shared_expert_hidden, or · moe.expert_hidden where that is 0)"),
    (dict(tp=2), dict(ffn_hidden=0, shared_hidden=66), None),  # 0: no dense MLP
])
def test_model_checks(sizes, model, message):
    dims = ParallelDims(world=24, **sizes)
    if message is None:
        dims.validate(**{**MODEL, **model})
        return
    with pytest.raises(ConfigError) as e:
        dims.validate(**{**MODEL, **model})
    assert str(e.value) == message


@pytest.mark.parametrize("preset, overrides, message", [
    ("tiny-deepseek", {"model.ffn_hidden": "99"}, "model.ffn_hidden=99"),  # its dense first layer
    ("tiny-deepseek", {"moe.shared_expert_hidden": "33"}, "shared experts' hidden size 33"),
    ("tiny-deepseek", {"moe.expert_hidden": "33"}, "shared experts' hidden size 33"),
    ("tiny-deepseek", {"moe.shared_experts": "2", "moe.shared_expert_hidden": "33"}, None),  # 66 splits
    ("tiny-qwen3", {"model.ffn_hidden": "99"}, None),  # every layer MoE: no dense MLP to split
    ("tiny-qwen3", {"moe.expert_hidden": "33"}, None),  # no shared experts; routed ones are not TP's
])
def test_tp_must_divide_the_hidden_sizes_it_splits(preset, overrides, message):
    """A hidden size TP splits column-wise (a dense MLP's, the shared experts') that tp does not
    divide: refused by the config in one line, not a shape error in the first forward ('a and b
    must have same reduction dim'); a size the model does not build is not checked."""
    overrides = {"parallel.tp": "2", "train.seq_len": "16", **overrides}
    if message is None:
        load_config(preset, overrides)
        return
    with pytest.raises(ConfigError, match=f"^parallel.tp=2 does not divide .*{message}"):
        load_config(preset, overrides)


def test_rank_grid_names_both_layouts():
    text = rank_grid(ParallelDims(8, tp=2, cp=2, ep=8))
    assert "attention (pp, dp, cp, tp) = (1, 2, 2, 2)" in text
    assert "experts   (pp, edp, ep, etp) = (1, 1, 8, 1)" in text
    assert "  tp      [0 1] [2 3] [4 5] [6 7]" in text
    assert "  ep      [0 1 2 3 4 5 6 7]" in text
    assert "   5    0   1   0   1 |    0   5    0" in text


def test_rank_grid_of_any_world_shows_the_first_groups_and_ranks():
    """Only what is shown is enumerated: `config show --world-size 2147483648` hung, listing
    every group (and every rank of a data-parallel group of 2^30)."""
    world = 2**40
    text = rank_grid(ParallelDims(world, tp=2, ep=8))
    first_tp = " ".join(f"[{r} {r + 1}]" for r in range(0, 32, 2))
    assert f"  tp      {first_tp} ... ({world // 2} groups)\n" in text
    evens, odds = " ".join(map(str, range(0, 32, 2))), " ".join(map(str, range(1, 32, 2)))
    assert f"  dp      [{evens} ... ({world // 2} ranks)] [{odds} ... ({world // 2} ranks)]\n" in text
    assert "  ep      [0 1 2 3 4 5 6 7] [8 9 10 11 12 13 14 15] " in text
    assert "rank " not in text  # no per-rank table beyond 64 ranks


# ---------------------------------------------------------------------------------------------
# Process groups on gloo ranks
# ---------------------------------------------------------------------------------------------


def _in_gloo_group(rank: int, fn, *args) -> None:
    dist.init_process_group("gloo")  # env://, as ranks.run_ranks sets it
    fn(rank, *args)


def run_on_ranks(fn, world: int, *args) -> None:
    """Run `fn(rank, *args)` on `world` gloo ranks on CPU, in the process group; an exception on
    any rank fails."""
    run_ranks(world, _in_gloo_group, fn, *args)


def results_on_ranks(fn, world: int, out_dir: Path, *args) -> list:
    """`run_on_ranks`, returning what `fn(rank, *args)` returned on each rank (a JSON value), in
    rank order: each rank writes it to `out_dir`, one file a rank."""
    run_on_ranks(_write_result, world, fn, str(out_dir), *args)
    return [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(world)]


def _write_result(rank: int, fn, out_dir: str, *args) -> None:
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(fn(rank, *args)))


def _check_layout(rank: int, sizes: list[dict]) -> None:
    for size in sizes:
        dims = ParallelDims(4, **size)
        layout = ParallelLayout(dims)
        assert layout.attention_coords == attention_coords(dims, rank)
        assert layout.expert_coords == expert_coords(dims, rank)
        for name in GROUPS:
            mine = next(g for g in group_ranks(dims, name) if rank in g)
            assert dist.get_process_group_ranks(layout.group(name)) == mine, (size, name)
        for name in ("ep", "tp"):
            expected = sum(next(g for g in group_ranks(dims, name) if rank in g))
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=layout.group(name))
            assert x.item() == expected, (size, name, x.item(), expected)
        assert layout.expert_dp_mesh.mesh_dim_names == ("edp",)
        assert layout.dense_dp_mesh.size() == dims.dp * dims.cp


def test_parallel_layout_groups_on_gloo():
    run_on_ranks(_check_layout, 4, [dict(tp=2, ep=4), dict(tp=2, ep=2, etp=2), dict(cp=2, ep=2)])
