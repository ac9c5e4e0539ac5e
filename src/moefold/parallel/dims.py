"""Parallel folding: one rank order, two layouts of the same ranks.

Attention and dense layers see the ranks as a grid `(pp, dp, cp, tp)`; MoE layers see the same
ranks as `(pp, edp, ep, etp)`. Both grids come from one rank order (default `tp-cp-ep-dp-pp`,
first name fastest-varying), as in Megatron-Core's parallel folding: the attention grid reads the
order with ep=1, the expert grid reads it with cp=1, tp→etp and dp→edp. With pp last, a pipeline
stage holds the same ranks in both layouts, and EP may fold across TP×CP×DP ranks (8 ranks:
attention TP2·CP2·DP2, experts EP8).

Everything above `ParallelLayout` is plain arithmetic, importable without torch, so every layout
can be unit-tested and printed (`moefold config show`) without processes. `ParallelLayout` builds
the `DeviceMesh`es on an initialised process group and hands groups to modules; there is no global
parallel state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from moefold.errors import ConfigError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
ORDER_NAMES = ("tp", "cp", "ep", "dp", "pp")
ATTENTION_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")
# The expert grid's dims read the order's names: etp takes tp's place, edp takes dp's.
_EXPERT_TO_ORDER = {"pp": "pp", "edp": "dp", "ep": "ep", "etp": "tp"}
# Every group a layout exposes: its name, the grid it lives in and the grid dims it spans.
GROUPS = {
    "tp": ("attention", ("tp",)),
    "cp": ("attention", ("cp",)),
    "dp": ("attention", ("dp",)),
    "dp_cp": ("attention", ("dp", "cp")),
    "pp": ("attention", ("pp",)),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("etp",)),
    "edp": ("expert", ("edp",)),
    "ep_etp": ("expert", ("ep", "etp")),
}

Coord = tuple[int, ...]


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of a parallel layout. Constructing one checks everything that depends only on the
    sizes (divisibility of the world, the order); `validate` checks them against the model."""

    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name in ("world", "tp", "cp", "pp", "ep", "etp"):
            value = getattr(self, name)
            label = (f"parallel: world size {value}" if name == "world"
                     else f"parallel.{name}={value}")
            _require(isinstance(value, int) and value >= 1, f"{label} must be >= 1")
        names = self.order.split("-")
        _require(sorted(names) == sorted(ORDER_NAMES),
                 f"parallel.order={self.order!r} must name each of {', '.join(ORDER_NAMES)} once, "
                 f"joined by '-' (default {DEFAULT_ORDER})")
        _require(self.world % (self.tp * self.cp * self.pp) == 0,
                 f"parallel: world size {self.world} is not divisible by tp·cp·pp = "
                 f"{self.tp * self.cp * self.pp} (tp={self.tp}, cp={self.cp}, pp={self.pp})")
        _require(self.world % (self.etp * self.ep * self.pp) == 0,
                 f"parallel: world size {self.world} is not divisible by etp·ep·pp = "
                 f"{self.etp * self.ep * self.pp} (etp={self.etp}, ep={self.ep}, pp={self.pp})")
        # Megatron-Core asserts the same: a pipeline stage must hold the same ranks in both
        # layouts, or a stage's attention and experts would live on different GPUs.
        attention, experts = _stride_below_pp(self, "attention"), _stride_below_pp(self, "expert")
        _require(self.pp == 1 or attention[0] == experts[0],
                 f"parallel.order={self.order!r} gives attention and experts different pipeline "
                 f"stages: the sizes before pp group attention's ranks by {attention[1]} = {attention[0]} "
                 f"and the experts' by {experts[1]} = {experts[0]}; put pp last (or first)")

    @classmethod
    def smallest(cls, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                 order: str = DEFAULT_ORDER) -> ParallelDims:
        """The layout on the fewest ranks both grids fit, lcm(tp·cp·pp, etp·ep·pp): for checks and
        printing before the job's world size is known."""
        sizes_ok = min(tp, cp, pp, ep, etp) >= 1  # else let __post_init__ name the bad size
        world = math.lcm(tp * cp * pp, etp * ep * pp) if sizes_ok else 1
        return cls(world, tp, cp, pp, ep, etp, order)

    @property
    def dp(self) -> int:
        """Data-parallel size of attention and dense layers: world / (tp·cp·pp)."""
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Data-parallel size of the experts: world / (etp·ep·pp)."""
        return self.world // (self.etp * self.ep * self.pp)

    def validate(self, num_experts: int, n_heads: int, n_kv_heads: int, n_layers: int,
                 seq_len: int, expert_hidden: int = 0, ffn_hidden: int = 0, shared_hidden: int = 0) -> None:
        """Raise ConfigError for the first size that does not fit the model (n_kv_heads=0 means
        n_heads; expert_hidden=0 skips the etp check; ffn_hidden / shared_hidden, the hidden sizes
        of the dense MLPs and of a layer's shared experts together, 0 where the model has none)."""
        if num_experts == 0:
            _require(self.ep == 1 and self.etp == 1,
                     f"parallel.ep={self.ep}, parallel.etp={self.etp} need routed experts "
                     "(moe.num_experts=0 makes every layer dense)")
        _require(num_experts % self.ep == 0,
                 f"parallel.ep={self.ep} does not divide moe.num_experts={num_experts}")
        _require(expert_hidden % self.etp == 0,
                 f"parallel.etp={self.etp} does not divide moe.expert_hidden={expert_hidden}")
        _require(n_heads % self.tp == 0,
                 f"parallel.tp={self.tp} does not divide model.n_heads={n_heads} "
                 "(each TP rank holds whole query heads)")
        n_kv = n_kv_heads or n_heads
        _require(n_kv % self.tp == 0,
                 f"parallel.tp={self.tp} does not divide model.n_kv_heads={n_kv} "
                 "(each TP rank holds whole key/value heads)")
        # TP splits these hidden dims column-wise: an uneven split fails in the first forward.
        _require(ffn_hidden % self.tp == 0,
                 f"parallel.tp={self.tp} does not divide model.ffn_hidden={ffn_hidden} "
                 "(the dense MLP's hidden units split evenly over the TP ranks)")
        _require(shared_hidden % self.tp == 0,
                 f"parallel.tp={self.tp} does not divide the shared experts' hidden size {shared_hidden} "
                 "(moe.shared_experts · moe.shared_expert_hidden, or · moe.expert_hidden where that is 0)")
        if self.cp > 1:
            # Load-balanced causal CP splits a sequence into 2·cp chunks, rank i taking i and
            # 2·cp-1-i, so every rank does the same attention work.
            _require(seq_len % (2 * self.cp) == 0,
                     f"parallel.cp={self.cp} needs train.seq_len={seq_len} divisible by "
                     f"2·cp = {2 * self.cp}")
        _require(n_layers >= self.pp,
                 f"parallel.pp={self.pp} exceeds model.n_layers={n_layers} "
                 "(every pipeline stage needs at least one layer)")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# ---------------------------------------------------------------------------------------------
# The two grids: plain arithmetic over the rank order
# ---------------------------------------------------------------------------------------------


def _grid_sizes(dims: ParallelDims, grid: str) -> dict[str, int]:
    """Size of each grid dim, keyed by grid dim name, in the grid's dim order."""
    if grid == "attention":
        return {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
    return {"pp": dims.pp, "edp": dims.edp, "ep": dims.ep, "etp": dims.etp}


def _stride_below_pp(dims: ParallelDims, grid: str) -> tuple[int, str]:
    """How far apart the ranks of one of `grid`'s pp groups are, and the product of grid dims
    that makes it ('tp·cp'). A pp group is the ranks `stride` apart, stride the product of the
    sizes before pp in the order; so both grids put every rank in the same pp group exactly when
    their strides agree (or pp = 1). O(1): no enumeration of a world of any size."""
    names = dims.order.split("-")
    names_before_pp, sizes = names[:names.index("pp")], _grid_sizes(dims, grid)
    to_order = _order_names(grid, sizes)
    below = [d for d in reversed(sizes) if to_order[d] in names_before_pp]
    return math.prod(sizes[d] for d in below), "·".join(below) or "nothing"


def _order_names(grid: str, sizes: dict[str, int]) -> dict[str, str]:
    """Each of the grid's dims → its name in `parallel.order` (etp → tp, edp → dp)."""
    return _EXPERT_TO_ORDER if grid == "expert" else {d: d for d in sizes}


def _rank_at(dims: ParallelDims, grid: str, coord: Coord) -> int:
    """The rank at `coord` (in the grid's dim order): a mixed-radix number whose digits are the
    coordinates, least significant first in `dims.order`."""
    sizes = _grid_sizes(dims, grid)
    to_order = _order_names(grid, sizes)
    by_name = {to_order[d]: (c, sizes[d]) for d, c in zip(sizes, coord)}
    rank, stride = 0, 1
    for name in dims.order.split("-"):
        c, size = by_name.get(name, (0, 1))  # ep in the attention grid, cp in the expert grid
        rank += c * stride
        stride *= size
    return rank


def _coords(dims: ParallelDims, grid: str) -> dict[Coord, int]:
    """Every coordinate of the grid and its rank, in row-major grid order."""
    ranges = [range(s) for s in _grid_sizes(dims, grid).values()]
    return {coord: _rank_at(dims, grid, coord) for coord in itertools.product(*ranges)}


def _nested(dims: ParallelDims, grid: str) -> list:
    """The grid as nested lists of ranks (the `mesh` tensor of a DeviceMesh)."""
    sizes = list(_grid_sizes(dims, grid).values())
    flat = list(_coords(dims, grid).values())
    for size in reversed(sizes[1:]):
        flat = [flat[i:i + size] for i in range(0, len(flat), size)]
    return flat


def attention_mesh(dims: ParallelDims) -> list:
    """Ranks as nested lists of shape (pp, dp, cp, tp)."""
    return _nested(dims, "attention")


def expert_mesh(dims: ParallelDims) -> list:
    """Ranks as nested lists of shape (pp, edp, ep, etp)."""
    return _nested(dims, "expert")


def attention_coords(dims: ParallelDims, rank: int) -> Coord:
    """The (pp, dp, cp, tp) coordinates of `rank`."""
    return {r: c for c, r in _coords(dims, "attention").items()}[rank]


def expert_coords(dims: ParallelDims, rank: int) -> Coord:
    """The (pp, edp, ep, etp) coordinates of `rank`."""
    return {r: c for c, r in _coords(dims, "expert").items()}[rank]


def _strides(dims: ParallelDims, grid: str) -> dict[str, int]:
    """Each grid dim's stride in a rank's number (`_rank_at`'s place values)."""
    sizes = _grid_sizes(dims, grid)
    to_order = _EXPERT_TO_ORDER if grid == "expert" else {d: d for d in sizes}
    dim_of = {to_order[d]: d for d in sizes}
    strides, stride = {}, 1
    for name in dims.order.split("-"):
        if name in dim_of:  # ep in the attention grid, cp in the expert grid: size 1
            strides[dim_of[name]] = stride
            stride *= sizes[dim_of[name]]
    return strides


def _iter_groups(dims: ParallelDims, grid: str, span: tuple[str, ...]) -> Iterator[Iterator[int]]:
    """The rank lists that vary along the grid dims `span` with every other dim fixed, lazily (a
    world of any size costs what is read): each list in grid order (as DeviceMesh orders a
    flattened dim), the lists ordered by their first rank, whose span digits are all 0."""
    sizes, strides = _grid_sizes(dims, grid), _strides(dims, grid)
    spanned = [d for d in sizes if d in span]
    rest = sorted((d for d in sizes if d not in span), key=strides.__getitem__, reverse=True)
    for rest_digits in _counting([sizes[d] for d in rest]):
        first = sum(c * strides[d] for d, c in zip(rest, rest_digits))
        yield (first + sum(c * strides[d] for d, c in zip(spanned, digits))
               for digits in _counting([sizes[d] for d in spanned]))


def _counting(sizes: list[int]) -> Iterator[tuple[int, ...]]:
    """itertools.product of range(size) for each size (the last digit fastest), without the
    tuples product builds of its inputs first."""
    for number in range(math.prod(sizes)):
        digits = []
        for size in reversed(sizes):
            number, digit = divmod(number, size)
            digits.append(digit)
        yield tuple(reversed(digits))


def _groups(dims: ParallelDims, grid: str, span: tuple[str, ...]) -> list[list[int]]:
    return [list(group) for group in _iter_groups(dims, grid, span)]


def group_ranks(dims: ParallelDims, name: str) -> list[list[int]]:
    """Every group of kind `name` (tp, cp, dp, dp_cp, pp, ep, etp, edp or ep_etp) as rank lists."""
    if name not in GROUPS:
        raise ValueError(f"unknown group {name!r}; one of {', '.join(GROUPS)}")
    grid, span = GROUPS[name]
    return _groups(dims, grid, span)


# ---------------------------------------------------------------------------------------------
# Printing (moefold config show)
# ---------------------------------------------------------------------------------------------


def _fmt_groups(dims: ParallelDims, name: str, limit: int = 16) -> str:
    """The first `limit` groups of kind `name`, each by its first `limit` ranks."""
    grid, span = GROUPS[name]
    size = math.prod(n for d, n in _grid_sizes(dims, grid).items() if d in span)
    shown = []
    for group in itertools.islice(_iter_groups(dims, grid, span), limit):
        ranks = " ".join(map(str, itertools.islice(group, limit)))
        shown.append(f"[{ranks}{f' ... ({size} ranks)' if size > limit else ''}]")
    count = dims.world // size
    return " ".join(shown) + (f" ... ({count} groups)" if count > limit else "")


def rank_grid(dims: ParallelDims, max_ranks: int = 64) -> str:
    """Both layouts as text: sizes, the groups of each kind, and each rank's coordinates (the
    per-rank table only up to `max_ranks` ranks)."""
    lines = [f"world {dims.world}, order {dims.order} (first varies fastest)",
             f"attention (pp, dp, cp, tp) = ({dims.pp}, {dims.dp}, {dims.cp}, {dims.tp})",
             f"experts   (pp, edp, ep, etp) = ({dims.pp}, {dims.edp}, {dims.ep}, {dims.etp})",
             "groups:"]
    width = max(len(n) for n in GROUPS)
    for name in GROUPS:
        lines.append(f"  {name:<{width}}  {_fmt_groups(dims, name)}")
    if dims.world <= max_ranks:
        att = {r: c for c, r in _coords(dims, "attention").items()}
        exp = {r: c for c, r in _coords(dims, "expert").items()}
        lines.append("rank   pp  dp  cp  tp |  edp  ep  etp")
        for rank in range(dims.world):
            pp, dp, cp, tp = att[rank]
            _, edp, ep, etp = exp[rank]
            lines.append(f"{rank:>4} {pp:>4}{dp:>4}{cp:>4}{tp:>4} |{edp:>5}{ep:>4}{etp:>5}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------


class ParallelLayout:
    """The two DeviceMeshes of a `ParallelDims` on an initialised process group, and every group
    modules need, by name. Build it once per job (every rank must build it: creating a mesh is a
    collective) and pass groups down; there is no global."""

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelLayout needs an initialised default process group")
        world = dist.get_world_size()
        _require(world == dims.world,
                 f"parallel: the job has {world} ranks but the layout is for world size "
                 f"{dims.world}")
        self.dims = dims
        self.rank = dist.get_rank()
        self.attention_mesh = DeviceMesh(device_type, torch.tensor(attention_mesh(dims)),
                                         mesh_dim_names=ATTENTION_DIMS)
        self.expert_mesh = DeviceMesh(device_type, torch.tensor(expert_mesh(dims)),
                                      mesh_dim_names=EXPERT_DIMS)
        # DeviceMesh._flatten is private but the only way to get a flattened dim that stays part
        # of its root mesh (TorchTitan uses it the same way for dp_shard_cp).
        self.dense_dp_mesh = self.attention_mesh["dp", "cp"]._flatten("dp_cp")
        """Dense (non-expert) parameters are reduced and sharded over dp·cp."""
        self.ep_etp_mesh = self.expert_mesh["ep", "etp"]._flatten("ep_etp")
        self.expert_dp_mesh = self.expert_mesh["edp"]
        """Expert parameters are reduced and sharded over edp."""

    @property
    def attention_coords(self) -> Coord:
        """This rank's (pp, dp, cp, tp)."""
        return tuple(self.attention_mesh.get_coordinate())

    @property
    def expert_coords(self) -> Coord:
        """This rank's (pp, edp, ep, etp)."""
        return tuple(self.expert_mesh.get_coordinate())

    @property
    def tp_mesh(self):
        return self.attention_mesh["tp"]

    @property
    def cp_mesh(self):
        return self.attention_mesh["cp"]

    @property
    def pp_mesh(self):
        return self.attention_mesh["pp"]

    @property
    def ep_mesh(self):
        return self.expert_mesh["ep"]

    @property
    def etp_mesh(self):
        return self.expert_mesh["etp"]

    @property
    def tp_group(self):
        return self.attention_mesh.get_group("tp")

    @property
    def cp_group(self):
        return self.attention_mesh.get_group("cp")

    @property
    def dp_group(self):
        return self.attention_mesh.get_group("dp")

    @property
    def dp_cp_group(self):
        return self.dense_dp_mesh.get_group()

    @property
    def pp_group(self):
        return self.attention_mesh.get_group("pp")

    @property
    def ep_group(self):
        return self.expert_mesh.get_group("ep")

    @property
    def etp_group(self):
        return self.expert_mesh.get_group("etp")

    @property
    def edp_group(self):
        return self.expert_mesh.get_group("edp")

    @property
    def ep_etp_group(self):
        return self.ep_etp_mesh.get_group()

    def group(self, name: str):
        """The process group of kind `name` (as in `GROUPS`) that holds this rank."""
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; one of {', '.join(GROUPS)}")
        return getattr(self, f"{name}_group")
