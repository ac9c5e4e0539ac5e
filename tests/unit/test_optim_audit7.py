"""The optimizer and the learning-rate schedule against independent references: a schedule written
out from docs/optimizer.md's words, an uninterrupted run for a resumed one, torch.optim.AdamW for
PrecisionAwareAdamW, torch.nn.utils.clip_grad_norm_ for clipping, and the docs' rule for which
parameters decay, on the real models."""

import math

import pytest
import torch

from moefold.config import TrainConfig
from moefold.optim.schedule import build_scheduler

# ------------------------------------------------------------------------------------ schedule


def _uninterrupted_lrs(t: TrainConfig) -> list[float]:
    """The lr every step of a fresh run trains with, through torch's LambdaLR as the trainer."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=t.lr)
    sched = build_scheduler(opt, t)
    lrs = []
    for _ in range(t.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _optimizer_after(t: TrainConfig, steps: int) -> torch.optim.Optimizer:
    """An AdamW that trained `steps` steps under the schedule of `t` (its groups carry torch's
    `initial_lr` and a decayed `lr`, which its state dict saves)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=t.lr)
    sched = build_scheduler(opt, t)
    for _ in range(steps):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return opt


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_a_schedule_rebuilt_over_a_loaded_optimizer_follows_the_configs_lr(schedule):
    """build_scheduler says a resumed run's schedule peaks at the config's train.lr, not at the
    saved one. A loaded optimizer state dict puts back the saver's `initial_lr` (torch saves it
    with the group), and the schedule kept it: resumed with --train.lr 2e-4, a run saved at 1e-3
    trained on at 1e-3's rates (the trainer overwrote `initial_lr` itself before calling)."""
    kw = {"steps": 20, "warmup_steps": 3, "schedule": schedule}
    if schedule == "constant":
        kw["min_lr_ratio"] = TrainConfig.min_lr_ratio
    saved = _optimizer_after(TrainConfig(lr=1e-3, **kw), steps=8).state_dict()
    new = TrainConfig(lr=2e-4, **kw)
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=new.lr)
    resumed.load_state_dict(saved)
    build_scheduler(resumed, new, steps_done=8)
    assert resumed.param_groups[0]["lr"] == pytest.approx(_uninterrupted_lrs(new)[8], rel=1e-12)
