"""Learning-rate schedules: linear warm-up, then cosine, WSD (warmup-stable-decay) or constant.

Each is a function step → multiplier of the peak lr, used through torch's LambdaLR. Its state is
the step and the config: a resumed run rebuilds it at its step from the (possibly changed) config.
"""

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from moefold.config import TrainConfig


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


def cosine(step: int, *, steps: int, warmup: int, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd(step: int, *, steps: int, warmup: int, min_ratio: float, decay_fraction: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    decay_start = steps - int(decay_fraction * steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, steps - decay_start))
    return 1.0 - (1 - min_ratio) * progress


def constant(step: int, *, steps: int, warmup: int, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    return 1.0 if w is None else w


def build_scheduler(optimizer: Optimizer, t: TrainConfig, steps_done: int = 0) -> LambdaLR:
    """The schedule of `t` over `optimizer`, `steps_done` steps in: a resumed run rebuilds it from
    its config (its `initial_lr` the config's train.lr) rather than loading the saved one, whose
    peak lr would override a changed train.lr."""
    common = {"steps": t.steps, "warmup": t.warmup_steps, "min_ratio": t.min_lr_ratio}
    fn = {"cosine": partial(cosine, **common),
          "wsd": partial(wsd, **common, decay_fraction=t.decay_fraction),
          "constant": partial(constant, **common)}[t.schedule]
    return LambdaLR(optimizer, fn, last_epoch=steps_done - 1)
