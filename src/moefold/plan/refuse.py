"""What training refuses of a config that its validation (config.py) cannot see, because it needs
the built model or the world size; the plan refuses the same, in the same words (a plan for a run
that cannot start is no plan).

The model is built on the meta device, as the trainer builds it, in the compute dtype the plan
assumes, and FP8 applied as the trainer applies it: the refusals are the build's own
(`precision.fp8_exclude` patterns matching no module, FP8 or grouped_mm experts whose features the
kernels cannot tile), so it is built only where one of those options is set.
"""

from __future__ import annotations

import torch

from moefold.config import Config
from moefold.errors import ConfigError


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
        return  # nothing the build refuses (and it takes ~1 ms a layer, the plan itself 0.1 ms)
    with torch.device("meta"), tensor_sizes():  # shapes only: nothing is allocated
        model = build_model(cfg, vocab_size, "cpu", compute_dtype)
    apply_fp8(model, cfg.precision, "cpu", compute_dtype=compute_dtype,
              sequence_parallel=cfg.parallel.shards_sequence, tp=cfg.parallel.tp, etp=cfg.parallel.etp)
