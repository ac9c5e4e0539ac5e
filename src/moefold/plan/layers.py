"""A chunk's layers as runs of layers the planner sees alike, so that planning a model costs the same
for 8 layers as for 10^8.

Everything the planner reads of a block depends on its layer id only through: whether it is an
MoE layer (moe.first_k_dense, moe.moe_every, moe.dense_layers), whether it is an MTP block, whether
it runs FP8 (precision.fp8_bf16_first_layers / _last_layers) and which of its modules
precision.fp8_exclude keeps in high precision (`fp8_module`, matched against "layers.{i}.…").
Between the boundaries those set, a layer's kind repeats with period moe.moe_every: one MoE layer
then moe_every − 1 dense ones. `layer_runs` lists such a range as `Run`s in forward order, and the
middle repetitions of a long period as runs that are not walked (`Run.walked`): the planner's
walks over a chunk's layers (plan.memory's forward and backward peaks) add the same amount with
every layer of a run and every repetition of a period, so their largest value lies at the first
or last layer of a run in the first or last repetition.

An fp8_exclude pattern can name layers by their number: "layers.3.*" names one layer (a run of its
own); a pattern whose match depends on the digits otherwise ("layers.1*", "*3.ffn") makes every
layer a run of its own, as costly as the planner was before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moefold.config import Config


@dataclass(frozen=True)
class Run:
    """`count` layers the planner sees as one: `layer` is one of them (the first, where walked)."""
    layer: int
    count: int
    walked: bool = True  # False: the middle repetitions of a period, which only add to sums


def layer_runs(cfg: Config, layers: range) -> list[Run]:
    """`layers` (a step-1 range of layer ids, MTP blocks numbered on from model.n_layers) as runs,
    in forward order."""
    if _digits_matter(cfg):
        return [Run(i, 1) for i in layers]
    cuts = {layers.start, layers.stop} | {b for b in _boundaries(cfg) if layers.start < b < layers.stop}
    ordered = sorted(cuts)
    return [run for a, b in zip(ordered, ordered[1:]) for run in _segment_runs(cfg, a, b)]


def _fp8_on(cfg: Config) -> bool:
    return cfg.precision.fp8 != "off"


def _boundaries(cfg: Config) -> set[int]:
    """Layer ids where a layer's kind may change other than by moe.moe_every's period: each id in
    moe.dense_layers or pinned by an fp8_exclude pattern is a run of its own."""
    m, moe, p = cfg.model, cfg.moe, cfg.precision
    cuts = {m.n_layers, moe.first_k_dense}
    singles = set(moe.dense_layers)
    if _fp8_on(cfg):
        cuts |= {p.fp8_bf16_first_layers, m.n_layers - p.fp8_bf16_last_layers}
        singles |= {pinned_layer(cfg, pattern) for pattern in p.fp8_exclude} - {None}
    return cuts | singles | {i + 1 for i in singles}


def _segment_runs(cfg: Config, start: int, stop: int) -> list[Run]:
    """Runs of `start` .. `stop` − 1, a range no boundary cuts: all dense, or after
    moe.first_k_dense one MoE layer every moe.moe_every."""
    moe = cfg.moe
    every = moe.moe_every
    if stop - start == 1 or moe.num_experts == 0 or start < moe.first_k_dense or every == 1:
        return [Run(start, stop - start)]
    first_moe = start + (moe.first_k_dense - start) % every
    runs = [Run(start, min(first_moe, stop) - start)] if first_moe > start else []
    periods, rest = divmod(max(stop - first_moe, 0), every)

    def period(at: int, walked: bool = True, times: int = 1) -> list[Run]:
        return [Run(at, times, walked), Run(at + 1, times * (every - 1), walked)]

    if periods > 2:  # the middle repetitions add to sums only
        runs += period(first_moe) + period(first_moe, walked=False, times=periods - 2) \
            + period(first_moe + (periods - 1) * every)
    else:
        runs += [run for k in range(periods) for run in period(first_moe + k * every)]
    tail = first_moe + periods * every
    if rest:
        runs.append(Run(tail, 1))
    if rest > 1:
        runs.append(Run(tail + 1, rest - 1))
    return runs


# A pattern's digits can only meet a layer number where they follow a ".", a "*" or its start (a
# layer number follows "layers."; "w2", "wq_a" cannot meet it); "?" and "[...]" can match a digit.
_LAYER_DIGITS = re.compile(r"(^|[.*])[0-9]|[?\[]")
_PINNED = re.compile(r"^(mtp\.)?layers\.([0-9]+)(\..*)?$")


def pinned_layer(cfg: Config, pattern: str) -> int | None:
    """The layer id a pattern names by its number ("layers.3.*", "mtp.layers.0.block"), where the
    rest of it is matched alike for every layer; else None."""
    found = _PINNED.match(pattern)
    if not found or _LAYER_DIGITS.search(found.group(3) or ""):
        return None
    number = int(found.group(2))
    return cfg.model.n_layers + number if found.group(1) else number


def renumber_pinned(pattern: str, number: int) -> str:
    """`pattern`, which names a layer by its number (`pinned_layer`), naming layer `number` of the
    same stack (main or MTP) instead."""
    mtp, _, rest = _PINNED.match(pattern).groups()
    return f"{mtp or ''}layers.{number}{rest or ''}"


def _digits_matter(cfg: Config) -> bool:
    """Whether an fp8_exclude pattern's match may depend on a layer's number other than by naming
    one layer (`pinned_layer`): then each layer is planned on its own."""
    return _fp8_on(cfg) and any(_LAYER_DIGITS.search(pattern) and pinned_layer(cfg, pattern) is None
                                for pattern in cfg.precision.fp8_exclude)
