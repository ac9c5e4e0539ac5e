"""What training refuses of a config that its validation (config.py) cannot see, because it needs
the built model or the world size; the plan refuses the same, in the same words (a plan for a run
that cannot start is no plan).

The model is built on the meta device, as the trainer builds it, in the compute dtype the plan
assumes, and FP8 applied as the trainer applies it: the refusals are the build's own
(`precision.fp8_exclude` patterns matching no module, FP8 or grouped_mm experts whose features the
kernels cannot tile), so it is built only where one of those options is set.

It is built with one layer of each run of layers the planner sees alike (plan.layers), not all of
them (1.4 to 3.6 ms a layer, deepseek-v3's the most: 10^8 layers took days): what the build
refuses depends on a layer's number only through what those runs tell apart (MoE or dense, MTP or
not, FP8 or kept in bf16 by precision.fp8_bf16_first/last_layers, an fp8_exclude pattern naming it
by number). That model is the config's own with the chosen layers renumbered 0, 1, ...
(`_Representatives`): the bf16 first/last counts and the patterns naming a layer follow them, and
an error that quotes a renamed pattern quotes the user's. Where a pattern's match depends on the
digits otherwise ("layers.1*"), every layer is its own run and the whole model is built.
"""

from __future__ import annotations

import dataclasses

import torch

from moefold.config import Config, MoEConfig
from moefold.errors import ConfigError
from moefold.plan.layers import layer_runs, pinned_layer, renumber_pinned


def refuse_weight_cache_over_fsdp(cfg: Config, layout) -> None:
    """The cache quantizes each rank's whole expert weights between steps, which FSDP shards
    over edp (it gathers them only inside the forward and backward). `layout`: anything with
    `dims.edp`, or None (one process)."""
    if cfg.precision.fp8_weight_cache and layout is not None and cfg.parallel.data_parallel == "fsdp" \
            and layout.dims.edp > 1:
        raise ConfigError(f"precision.fp8_weight_cache=true needs the experts' weights whole on each rank; "
                          f"parallel.data_parallel=fsdp shards them over edp={layout.dims.edp}: use "
                          "parallel.data_parallel=ddp, or set precision.fp8_weight_cache=false")


def refuse_unbuildable(cfg: Config, vocab_size: int, compute_dtype: torch.dtype, layout) -> None:
    """ConfigError where training would refuse to build `cfg`'s model in `compute_dtype` on
    `layout` (`refuse_weight_cache_over_fsdp`'s)."""
    from moefold.fp8.apply import apply_fp8
    from moefold.models.transformer import build_model
    from moefold.train.flops import tensor_sizes

    refuse_weight_cache_over_fsdp(cfg, layout)
    if cfg.precision.fp8 == "off" and cfg.moe.experts_backend != "grouped_mm":
        return  # nothing the build refuses
    stand_in = _Representatives.of(cfg)
    with torch.device("meta"), tensor_sizes():  # shapes only: nothing is allocated
        try:
            model = build_model(stand_in.cfg, vocab_size, "cpu", compute_dtype)
            apply_fp8(model, stand_in.cfg.precision, "cpu", compute_dtype=compute_dtype,
                      sequence_parallel=cfg.parallel.shards_sequence, tp=cfg.parallel.tp, etp=cfg.parallel.etp)
        except ConfigError as error:
            raise stand_in.in_users_words(error) from None


@dataclasses.dataclass(frozen=True)
class _Representatives:
    """`cfg` of a model made of one layer per run of the user's model (main stack and MTP blocks
    alike), numbered 0, 1, ... in order, each of the kind of the layer it stands for; `renamed`:
    each fp8_exclude pattern renumbered to name the stand-in of the layer it names, to the user's."""
    cfg: Config
    renamed: dict[str, str]

    @staticmethod
    def of(cfg: Config) -> "_Representatives":
        m = cfg.model
        chosen = sorted({run.layer for run in layer_runs(cfg, range(m.n_layers + m.mtp_layers))})
        if len(chosen) == m.n_layers + m.mtp_layers:
            return _Representatives(cfg, {})  # every layer its own run: the model itself
        main, mtp = [i for i in chosen if i < m.n_layers], [i for i in chosen if i >= m.n_layers]
        new_number = {layer: number for number, layer in enumerate(main)}
        new_number |= {layer: number for number, layer in enumerate(mtp)}
        patterns = [(_renumbered(cfg, old, new_number), old) for old in cfg.precision.fp8_exclude]
        if any(new is None for new, _ in patterns):  # a layer named that stands for none: build them all
            return _Representatives(cfg, {})
        p = cfg.precision
        precision = dataclasses.replace(
            p, fp8_exclude=[new for new, _ in patterns],
            fp8_bf16_first_layers=sum(i < p.fp8_bf16_first_layers for i in main),
            fp8_bf16_last_layers=sum(i >= m.n_layers - p.fp8_bf16_last_layers for i in main))
        small = dataclasses.replace(cfg, model=dataclasses.replace(m, n_layers=len(main), mtp_layers=len(mtp)),
                                    moe=_moe_of(cfg, chosen), precision=precision)
        return _Representatives(small, {new: old for new, old in patterns if new != old})

    def in_users_words(self, error: ConfigError) -> ConfigError:
        """`error` quoting the user's fp8_exclude pattern where it quotes a renumbered one (as
        apply_fp8's 'pattern ... matches no module' does)."""
        message = str(error)
        for new, old in self.renamed.items():
            if f"pattern {new!r} " in message:
                return type(error)(message.replace(f"pattern {new!r} ", f"pattern {old!r} ", 1))
        return error


def _moe_of(cfg: Config, chosen: list[int]) -> MoEConfig:
    """cfg.moe with its layer pattern making stand-in k dense where layer chosen[k] is."""
    from moefold.models.transformer import is_moe_layer

    if cfg.moe.num_experts == 0:
        return cfg.moe
    dense = [k for k, layer in enumerate(chosen) if not is_moe_layer(cfg, layer)]
    return dataclasses.replace(cfg.moe, first_k_dense=0, moe_every=1, dense_layers=dense)


def _renumbered(cfg: Config, pattern: str, new_number: dict[int, int]) -> str | None:
    """`pattern` naming the stand-in of the layer it names by number ("layers.3.*",
    "mtp.layers.0.block"); unchanged where it names no layer by number, or one the model lacks (no
    module has that name in either model); None where the layer it names has no stand-in."""
    layer = pinned_layer(cfg, pattern)
    if layer is None:
        return pattern
    m = cfg.model
    mtp = pattern.startswith("mtp.")
    number = layer - m.n_layers if mtp else layer
    if number >= (m.mtp_layers if mtp else m.n_layers) or renumber_pinned(pattern, number) != pattern:
        return pattern  # no such layer, or its digits are not how a name writes it ("layers.03")
    return renumber_pinned(pattern, new_number[layer]) if layer in new_number else None
