"""Tests that kill mutants the rest of the suite let live: each pins down a behaviour of the optimizer,
its schedule, its fp8 blocks, the data loader, RoPE, RMSNorm or the FLOP count against an independent
reference (torch's own schedulers and AdamW, a naive formula, transformers), where a small change of
the source (an off-by-one, a dropped term, a swapped clamp) went unnoticed."""

import math

import pytest
import torch

from moefold.config import TrainConfig
from moefold.optim.schedule import build_scheduler, cosine, wsd

# ------------------------------------------------------------------------------------ schedule


def _torch_cosine_lrs(steps: int, warmup: int, lr: float, min_ratio: float) -> list[float]:
    """torch's own schedulers: LinearLR warm-up to the peak at step warmup - 1, then cosine annealing
    to min_ratio · lr over the steps - warmup steps left."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    parts, milestones = [], []
    if warmup > 1:
        parts.append(torch.optim.lr_scheduler.LinearLR(opt, 1 / warmup, 1.0, total_iters=warmup - 1))
        milestones.append(warmup - 1)
    parts.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - max(warmup, 1),
                                                            eta_min=min_ratio * lr))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, parts, milestones) if milestones else parts[0]
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("steps, warmup", [(50, 5), (12, 1), (9, 0), (30, 2)])
def test_cosine_follows_torchs_linear_warmup_and_cosine_annealing(steps, warmup):
    t = TrainConfig(steps=steps, warmup_steps=warmup, lr=3e-3, min_lr_ratio=0.1, schedule="cosine")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = build_scheduler(opt, t)
    ours = []
    for _ in range(steps):
        ours.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert ours == pytest.approx(_torch_cosine_lrs(steps, warmup, t.lr, 0.1), rel=1e-6)


@pytest.mark.parametrize("steps, fraction", [(10, 0.04), (20, 0.02), (3, 0.1)])
def test_wsd_with_a_decay_under_half_a_step_still_decays_over_one(steps, fraction):
    """round(fraction · steps) is 0: at least one step decays, so the last is still min_ratio."""
    m = [wsd(s, steps=steps, warmup=1, min_ratio=0.1, decay_fraction=fraction) for s in range(steps)]
    assert m[:-1] == [1.0] * (steps - 1)
    assert m[-1] == 0.1


def test_a_schedule_built_at_a_resumes_step_peaks_at_the_configs_lr_not_the_groups():
    """A group no schedule has set yet (no initial_lr) may hold a decayed saved lr: the rebuilt
    schedule takes train.lr as its peak, as build_scheduler's docstring says."""
    t = TrainConfig(steps=20, warmup_steps=2, lr=2e-3, min_lr_ratio=0.1, schedule="cosine")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=7e-5)  # a decayed saved value
    build_scheduler(opt, t, steps_done=6)
    want = 2e-3 * cosine(6, steps=20, warmup=2, min_ratio=0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    assert opt.param_groups[0]["initial_lr"] == 2e-3
