"""The learning-rate schedules at the points their documentation names: 1/warmup of the peak at
step 0, the peak at the warm-up's last step, train.min_lr_ratio of it at the run's last step
(steps - 1), WSD's decay over its last round(decay_fraction · steps) steps; and through the
optimizer and the trainer, fresh and resumed (also with a changed train.steps)."""

import json
import math

import pytest
import torch
from conftest import TINY_OVERRIDES, cli_args

from moefold.cli import main
from moefold.config import TrainConfig
from moefold.optim.schedule import build_scheduler, constant, cosine, wsd

# (steps, warmup): with and without warm-up, a warm-up filling the run, one step.
SHAPES = [(300, 30), (10, 2), (5, 0), (7, 1), (1, 0), (3, 3)]


def multipliers(fn, steps: int, warmup: int, **kw) -> list[float]:
    return [fn(s, steps=steps, warmup=warmup, min_ratio=0.1, **kw) for s in range(steps)]


@pytest.mark.parametrize("steps, warmup", SHAPES)
@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_warmup_peak_and_last_step(name, steps, warmup):
    fn = {"cosine": cosine, "wsd": wsd, "constant": constant}[name]
    kw = {"decay_fraction": 0.2} if name == "wsd" else {}
    m = multipliers(fn, steps, warmup, **kw)
    assert m[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    peak = max(warmup - 1, 0)  # the warm-up's last step, or the first step without one
    assert m[peak] == 1.0
    decays = name != "constant" and steps - 1 > peak
    assert m[-1] == pytest.approx(0.1 if decays else 1.0)
    assert all(a >= b for a, b in zip(m[peak:], m[peak + 1:]))  # never rises after the peak
    assert max(m) == 1.0
    if name == "cosine":  # one step at the peak (the first step after warm-up repeated it)
        assert m[peak + 1:].count(1.0) == 0


@pytest.mark.parametrize("steps, fraction, decayed", [(10, 0.1, 1), (10, 0.2, 2), (4, 0.2, 1), (100, 0.29, 29),
                                                      (300, 0.2, 60), (10, 1.0, 8)])
def test_wsd_decays_over_its_last_steps(steps, fraction, decayed):
    """decay_fraction · steps steps below the peak, rounded, at least one (it truncated 0.29 · 100 =
    28.999... to 28, and a one-step decay, or one under a step, never left the peak), none in the
    warm-up (10 steps, fraction 1, warm-up 2: the 8 after it)."""
    m = multipliers(wsd, steps, 2, decay_fraction=fraction)
    assert sum(1 for x in m[2:] if x < 1.0) == decayed
    assert m[-1] == pytest.approx(0.1)
    decay = m[steps - decayed - 1:]  # from the last step at the peak: a straight line to 0.1
    assert decay == pytest.approx([1 - 0.9 * i / decayed for i in range(decayed + 1)])


def test_cosine_is_half_way_at_the_middle_of_its_decay():
    m = multipliers(cosine, 21, 1)  # the peak at step 0, the last step 20: half way at 10
    assert m[10] == pytest.approx(0.55)
    assert m[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))


def _lrs(t: TrainConfig, steps_done: int = 0) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = build_scheduler(opt, t)  # as the trainer: built fresh, then at a resume's step
    if steps_done:
        sched = build_scheduler(opt, t, steps_done)
    lrs = []
    for _ in range(steps_done, t.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_optimizer_steps_with_the_schedule_and_a_resume_rebuilds_it(schedule):
    t = TrainConfig(steps=12, warmup_steps=3, lr=2e-3, min_lr_ratio=0.1, schedule=schedule)
    lrs = _lrs(t)
    assert lrs[0] == pytest.approx(2e-3 / 3) and lrs[2] == 2e-3 and lrs[-1] == pytest.approx(2e-4)
    assert _lrs(t, steps_done=5) == lrs[5:]
    # A resume with more steps continues on the longer schedule, down to the same final lr.
    longer = TrainConfig(steps=20, warmup_steps=3, lr=2e-3, min_lr_ratio=0.1, schedule=schedule)
    assert _lrs(longer, steps_done=12) == _lrs(longer)[12:]
    assert _lrs(longer, steps_done=12)[-1] == pytest.approx(2e-4)


def test_a_run_logs_the_peak_at_the_end_of_warmup_and_the_final_lr_last(tmp_path, text_corpus):
    overrides = {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "6", "train.warmup_steps": "2",
                 "train.lr": "1e-3", "train.min_lr_ratio": "0.25", "train.schedule": "wsd",
                 "train.decay_fraction": "0.2"}
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *cli_args(overrides)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]  # logged steps 1..6 (1-based)
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 2.5e-4])


@pytest.mark.parametrize("min_ratio", [0.1, 0.2, 0.3, 0.01, 1 / 3, 0.0, 1.0])
@pytest.mark.parametrize("name", ["cosine", "wsd"])
def test_the_last_step_is_exactly_the_min_ratio(name, min_ratio):
    """As documented, exactly train.min_lr_ratio at the last step, not within rounding: WSD ended at
    1 − (1 − min_ratio), 0.09999999999999998 for the default 0.1."""
    fn = {"cosine": cosine, "wsd": wsd}[name]
    kw = {"decay_fraction": 0.3} if name == "wsd" else {}
    for steps, warmup in ((10, 1), (300, 30), (5, 0), (4, 3)):
        assert fn(steps - 1, steps=steps, warmup=warmup, min_ratio=min_ratio, **kw) == min_ratio
