"""Learning-rate schedules: linear warm-up, then cosine, WSD (warmup-stable-decay) or constant.

Each is a function step → multiplier of the peak lr, used through torch's LambdaLR; steps count
from 0 and the run's last step is `steps - 1`. Warm-up rises linearly to the peak at its last step
(`warmup - 1`: 1/warmup at step 0); cosine and WSD's decay end at exactly `min_ratio` on the last
step, so the final learning rate is train.min_lr_ratio · train.lr (TorchTitan's arithmetic before its
virtual last step; without warm-up step 0 is the peak here, as torch's CosineAnnealingLR).
The state is the step and the config: a resumed run rebuilds the schedule at its step from the
(possibly changed) config, so a longer train.steps stretches what is left of the decay.
"""

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from moefold.config import TrainConfig


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


def _decay_progress(step: int, *, start: int, steps: int) -> float:
    """0 at `start` (the last step at the peak) to 1 at the last step, `steps - 1`."""
    return min(1.0, (step - start) / max(1, steps - 1 - start))


def cosine(step: int, *, steps: int, warmup: int, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    progress = _decay_progress(step, start=max(warmup - 1, 0), steps=steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd(step: int, *, steps: int, warmup: int, min_ratio: float, decay_fraction: float) -> float:
    """Peak until the last round(decay_fraction · steps) steps (at least one, and none of them in
    the warm-up), which decay linearly to `min_ratio` at the last step."""
    w = _warmup(step, warmup)
    if w is not None:
        return w
    decay_steps = max(1, round(decay_fraction * steps))
    start = max(steps - 1 - decay_steps, warmup - 1, 0)
    if step <= start:
        return 1.0
    # min_ratio plus what is left: exactly min_ratio at the end (1 − (1 − 0.1) is 0.09999999999999998)
    return min_ratio + (1 - min_ratio) * (1 - _decay_progress(step, start=start, steps=steps))


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
    for group in optimizer.param_groups:
        # torch's peak is `initial_lr` (needed past step 0, kept as found at step 0); a loaded state
        # dict puts back the saver's, and `lr` may be a decayed saved value: both give way to train.lr.
        group["initial_lr"] = t.lr
    return LambdaLR(optimizer, fn, last_epoch=steps_done - 1)
