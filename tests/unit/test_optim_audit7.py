"""The optimizer and the learning-rate schedule against independent references: a schedule written
out from docs/optimizer.md's words, an uninterrupted run for a resumed one, torch.optim.AdamW for
PrecisionAwareAdamW, torch.nn.utils.clip_grad_norm_ for clipping, and the docs' rule for which
parameters decay, on the real models."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moefold.config import OptimConfig, TrainConfig, load_config
from moefold.models.transformer import build_model
from moefold.optim.adamw import build_optimizer, clip_scaling, param_groups
from moefold.optim.blocks import dequantize_fp8, row_blocks
from moefold.optim.precision import PrecisionAwareAdamW, join_fp32
from moefold.optim.schedule import build_scheduler
from moefold.parallel.data import GradNormClipper

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
    saved = _optimizer_after(TrainConfig(lr=1e-3, **kw), steps=8).state_dict()
    new = TrainConfig(lr=2e-4, **kw)
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=new.lr)
    resumed.load_state_dict(saved)
    build_scheduler(resumed, new, steps_done=8)
    assert resumed.param_groups[0]["lr"] == pytest.approx(_uninterrupted_lrs(new)[8], rel=1e-12)


def _documented_multiplier(step: int, t: TrainConfig) -> float:
    """docs/optimizer.md's words: lr/warmup at step 0 rising to the peak at the warm-up's last step
    (the first step without one); cosine from that peak to min_lr_ratio at the last step, steps − 1;
    wsd at the peak but for its last round(decay_fraction · steps) steps (at least one, none in the
    warm-up), a straight line to min_lr_ratio; constant at the peak."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    peak, last = max(t.warmup_steps - 1, 0), t.steps - 1
    if t.schedule == "constant" or last == peak:
        return 1.0
    if t.schedule == "cosine":
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * (step - peak) / (last - peak))) / 2
    decaying = min(max(1, round(t.decay_fraction * t.steps)), last - peak)
    below_peak = step - (last - decaying)  # 1 at the first decayed step, `decaying` at the last
    return 1.0 if below_peak <= 0 else 1 - (1 - t.min_lr_ratio) * below_peak / decaying


SCHEDULES = [{"schedule": "cosine"}, {"schedule": "constant", "min_lr_ratio": TrainConfig.min_lr_ratio},
             *({"schedule": "wsd", "decay_fraction": f} for f in (0.04, 0.2, 0.5, 1.0))]


@pytest.mark.parametrize("kw", SCHEDULES, ids=lambda kw: "-".join(map(str, kw.values())))
@pytest.mark.parametrize("steps, warmup", [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (7, 0), (7, 3), (7, 6), (7, 7),
                                           (25, 5)])
def test_every_step_of_every_schedule_is_the_documented_lr_fresh_and_resumed_there(kw, steps, warmup):
    """Each step's lr, through torch's LambdaLR as the trainer drives it, is the documented one, and a
    schedule rebuilt at any step (a resume) continues the uninterrupted run's rates."""
    t = TrainConfig(steps=steps, warmup_steps=warmup, lr=3e-3, **{"min_lr_ratio": 0.25, **kw})
    lrs = _uninterrupted_lrs(t)
    assert lrs == pytest.approx([t.lr * _documented_multiplier(s, t) for s in range(steps)], rel=1e-12, abs=0)
    for done in range(1, steps):
        opt = _optimizer_after(t, done)
        build_scheduler(opt, t, steps_done=done)
        assert opt.param_groups[0]["lr"] == lrs[done], done


# ------------------------------------------------------------------------------ AdamW arithmetic


# (betas, eps, weight_decay): bias corrections at their extremes (beta 0: none; beta2 near 1: a
# correction of ~1e-6 at step 1), no decay, a decay of 0.9 of the weight per unit lr, a large eps.
EDGES = [((0.0, 0.0), 1e-8, 0.1), ((0.0, 0.999999), 1e-8, 0.1), ((0.999, 0.5), 1e-8, 0.0),
         ((0.9, 0.95), 1e-8, 9.0), ((0.9, 0.95), 0.5, 0.1)]
LRS = [0.0, 0.1, 1e-3, 0.0, 3e-2, 1e-5] * 10  # lr 0 between nonzero ones, as a warm-up from 0 has


def _edge_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in ((), (1,), (5, 130), (3, 4, 2))]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("betas, eps, wd", EDGES, ids=lambda v: str(v))
def test_fp32_precision_adamw_is_torch_adamw_bit_for_bit_at_edge_hyperparameters(betas, eps, wd, foreach):
    """60 steps, the lr changing every step (0 included), a 0-dim and a 1-element parameter among
    them: PrecisionAwareAdamW with fp32 states and torch.optim.AdamW give the same bits."""
    ref_params = [torch.nn.Parameter(x.clone()) for x in _edge_params()]
    params = [torch.nn.Parameter(x.clone()) for x in _edge_params()]
    hp = {"betas": betas, "eps": eps, "weight_decay": wd}
    ref = torch.optim.AdamW(ref_params, lr=1.0, foreach=False, **hp)
    opt = PrecisionAwareAdamW(params, lr=1.0, foreach=foreach, **hp)
    gen = torch.Generator().manual_seed(1)
    for step, lr in enumerate(LRS):
        for o in (ref, opt):
            o.param_groups[0]["lr"] = lr
        for p, q in zip(ref_params, params):
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 7 - 3)
            q.grad = p.grad.clone()
        ref.step()
        opt.step()
        for p, q in zip(ref_params, params):
            assert torch.equal(q, p), f"step {step}"
    for p, q in zip(ref_params, params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[q][key], ref.state[p][key]), key


MODES = [OptimConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
         OptimConfig(exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"), OptimConfig(master_dtype="bf16"),
         OptimConfig(master_dtype="bf16+remainder"),
         OptimConfig(exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16", master_dtype="bf16+remainder")]
"""PrecisionAwareAdamW's settings (the all-fp32 one is torch's AdamW)."""


def _mode_id(o: OptimConfig) -> str:
    return f"{o.exp_avg_dtype}-{o.exp_avg_sq_dtype}-{o.master_dtype}"


def _master(opt, p) -> torch.Tensor:
    state = opt.state[p]
    if "master_remainder" in state:
        return join_fp32(p.detach(), state["master_remainder"])
    return p.detach().float()


def _first_moment(opt, p) -> torch.Tensor:
    """exp_avg in fp32 (an fp8 one dequantized: its e4m3 values times the block scales)."""
    state = opt.state[p]
    if "exp_avg_scale" not in state:
        return state["exp_avg"].float().clone()
    return dequantize_fp8(state["exp_avg"], state["exp_avg_scale"], row_blocks(p))


@pytest.mark.parametrize("o", MODES, ids=_mode_id)
def test_an_lr_of_zero_leaves_every_master_as_it_was_and_still_counts_the_step(o):
    """torch's AdamW at lr 0 (a warm-up from 0, DCP's state initialisation) leaves the weights bit
    for bit and advances the moments and the step: every precision mode alike (decoupled decay is
    lr · weight_decay: none; the bf16 master is not rounded again, the remainder split is exact)."""
    params = [torch.nn.Parameter(x.clone()) for x in _edge_params()]
    opt = PrecisionAwareAdamW(params, lr=0.0, weight_decay=0.5, exp_avg_dtype=o.exp_avg_dtype,
                              exp_avg_sq_dtype=o.exp_avg_sq_dtype, master=o.master_dtype)
    gen = torch.Generator().manual_seed(1)
    for p in params:  # some steps first, so the moments are not zero
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    before = [_master(opt, p).clone() for p in params]
    moments = [_first_moment(opt, p) for p in params]
    opt.param_groups[0]["lr"] = 0.0
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    for p, x, m in zip(params, before, moments):
        assert torch.equal(_master(opt, p).view(torch.int32), x.view(torch.int32))
        assert opt.state[p]["step"].item() == 4.0
        assert not torch.equal(_first_moment(opt, p), m)


# ------------------------------------------------------------------------------ weight decay


@pytest.mark.parametrize("tie", ["false", "true"])
@pytest.mark.parametrize("preset, recompute", [("tiny-deepseek", []), ("tiny-deepseek", ["layer"]),
                                               ("tiny-qwen3", ["norm", "moe_act"]), ("tiny-mixtral", [])])
def test_weight_decay_falls_on_the_documented_parameters_of_the_real_models(preset, recompute, tie):
    """docs/optimizer.md: every parameter of two or more dimensions (attention, MLA and MTP
    projections, experts, routers, the untied head) decays, but the token embedding — the very
    tensor, also as a tied head — and no norm weight; the routers' expert bias is no parameter.
    (Megatron-Core also leaves out biases and 1-D tensors; it decays the embedding.) Each parameter
    once, recompute wrappers or not, for either optimizer."""
    cfg = load_config(preset, {"model.tie_embeddings": tie, "memory.recompute": recompute})
    model = build_model(cfg, vocab_size=300)
    embedding = model.tok_embeddings.weight
    want = {id(p): 0.1 if p.dim() >= 2 and p is not embedding else 0.0 for p in model.parameters()}
    assert any(v == 0.1 for v in want.values()) and sum(p.dim() == 1 for p in model.parameters()) > 2
    for o in (OptimConfig(), OptimConfig(exp_avg_dtype="bf16")):
        opt = build_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"), o)
        got = [(id(p), g["weight_decay"]) for g in opt.param_groups for p in g["params"]]
        assert len(got) == len(want) and dict(got) == want
    biases = [name for name, _ in model.named_buffers() if "expert_bias" in name]
    assert (len(biases) > 0) == (preset == "tiny-deepseek")  # a buffer: never in the optimizer


# ------------------------------------------------------------------------------ clipping


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=gen) * 3, torch.randn(8, 3, generator=gen)


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


# (device the optimizer is built for, optim settings): torch's foreach AdamW clipped in place;
# torch's fused AdamW (it runs on the CPU too) with the coefficient as its grad_scale; the
# precision-aware AdamW (bf16 first moment, fp32 master).
KERNELS = [("cpu", OptimConfig()), ("cuda", OptimConfig()), ("cpu", OptimConfig(exp_avg_dtype="bf16"))]


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("device, o", KERNELS[:2], ids=["foreach", "fused"])
def test_accumulated_gradients_clip_and_step_as_clip_grad_norm_and_torch_adamw(device, o, max_norm):
    """Two micro-batches of 4 accumulated as the trainer accumulates them ((loss / 2).backward()
    each), the norm over both param groups clipped through clip_scaling's strategy, then the
    step: torch.nn.utils.clip_grad_norm_ over the whole batch's gradients and torch's AdamW with
    the same groups give the same norm, gradients and weights."""
    model, ref_model = _small_model(), _small_model()
    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, t, torch.device(device), o)
    clip = GradNormClipper(list(model.parameters()), None, clip_scaling(opt, o))
    ref = torch.optim.AdamW(param_groups(ref_model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, foreach=False)
    assert len(opt.param_groups) == 2
    for step in range(5):
        x, y = _batch(step)
        for x_half, y_half in zip(x.split(4), y.split(4)):
            (_loss(model, x_half, y_half) / 2).backward()
        _loss(ref_model, x, y).backward()
        norm = clip(max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.step()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # left clipped, as torch's
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert (norm > max_norm) == (max_norm < 1)  # the clipped case clipped, the other did not


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("device, o", KERNELS, ids=["foreach", "fused", "precision"])
def test_a_non_finite_gradient_gives_torchs_norm_and_the_step_is_taken(device, o, bad):
    """docs/optimizer.md: a non-finite norm does not skip the step (the run stops at its next log
    step). The norm is clip_grad_norm_'s, and every weight ends where torch's clipped AdamW puts it
    (NaN where it does: a NaN coefficient poisons every gradient, an infinite norm zeroes them)."""
    model, ref_model = _small_model(), _small_model()
    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, t, torch.device(device), o)
    clip = GradNormClipper(list(model.parameters()), None, clip_scaling(opt, o))
    ref = torch.optim.AdamW(param_groups(ref_model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, foreach=False)
    for m in (model, ref_model):
        x, y = _batch(0)
        _loss(m, x, y).backward()
        m[0].weight.grad[0, 0] = bad
    norm, ref_norm = clip(1.0), torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    torch.testing.assert_close(norm, ref_norm, equal_nan=True)
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        got = _master(opt, p) if isinstance(opt, PrecisionAwareAdamW) else p.detach()
        torch.testing.assert_close(got, q.detach(), rtol=1e-6, atol=1e-7, equal_nan=True)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------ resume


RESUMED = [("cpu", OptimConfig()), ("cuda", OptimConfig()), *(("cpu", o) for o in MODES)]


class _Run:
    """The trainer's optimizer step on the small model: clip (clip_scaling's strategy), step, the
    schedule's step; its optimizer and schedule built as the trainer builds them."""

    def __init__(self, t: TrainConfig, device: str, o: OptimConfig):
        self.t, self.model = t, _small_model()
        self.opt = build_optimizer(self.model, t, torch.device(device), o)
        self.clip = GradNormClipper(list(self.model.parameters()), None, clip_scaling(self.opt, o))
        self.sched = build_scheduler(self.opt, t)
        self.lrs: list[float] = []

    def train(self, steps: range) -> None:
        dtype = next(self.model.parameters()).dtype
        for step in steps:
            x, y = _batch(step)
            _loss(self.model, x.to(dtype), y.to(dtype)).backward()
            self.lrs.append(self.opt.param_groups[0]["lr"])
            self.clip(0.5)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("device, o", RESUMED,
                         ids=["foreach", "fused", *map(_mode_id, MODES)])
def test_a_run_resumed_mid_schedule_through_dcp_continues_bit_for_bit(device, o, tmp_path):
    """Saved after 4 of 10 steps (inside the decay, past a 2-step warm-up) through DCP as the
    trainer saves, loaded into a freshly built model, optimizer and schedule, the schedule rebuilt
    at step 4: the last 6 steps train with the same rates and end with the same bits in every
    weight and every state, in its own dtype, as the run that never stopped."""
    t = TrainConfig(steps=10, warmup_steps=2, lr=1e-2, weight_decay=0.1, schedule="wsd", decay_fraction=0.5)
    whole = _Run(t, device, o)
    whole.train(range(4))
    model_sd, optim_sd = get_state_dict(whole.model, whole.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
    whole.train(range(4, 10))

    resumed = _Run(t, device, o)
    model_sd, optim_sd = get_state_dict(resumed.model, resumed.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(resumed.model, resumed.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed.sched = build_scheduler(resumed.opt, t, steps_done=4)
    resumed.train(range(4, 10))

    assert resumed.lrs == whole.lrs[4:] and len(set(resumed.lrs)) > 2
    for p, q in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(_bits(p), _bits(q))
    for p, q in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        s, r = whole.opt.state[p], resumed.opt.state[q]
        assert s.keys() == r.keys()
        for key in s:
            assert s[key].dtype == r[key].dtype and torch.equal(_bits(s[key]), _bits(r[key])), key


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["foreach", "fused"])
def test_bf16_gradients_are_the_clipped_gradients_rounded_once(device):
    """docs/optimizer.md: optim.grad_dtype=bf16 rounds every gradient to bf16 after clipping, once.
    Against clip_grad_norm_, then a bf16 round trip of each gradient, then torch's AdamW: the same
    weights and gradients with torch's foreach and its fused kernel (whose coefficient, handed to
    the kernel, would scale the rounded unclipped gradients instead)."""
    o = OptimConfig(grad_dtype="bf16")
    model, ref_model = _small_model(), _small_model()
    t = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, t, torch.device(device), o)
    clip = GradNormClipper(list(model.parameters()), None, clip_scaling(opt, o))
    ref = torch.optim.AdamW(param_groups(ref_model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, foreach=False)
    for step in range(3):
        for m in (model, ref_model):
            _loss(m, *_batch(step)).backward()
        clip(0.05)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        for q in ref_model.parameters():
            q.grad = q.grad.bfloat16().float()
        opt.step()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
