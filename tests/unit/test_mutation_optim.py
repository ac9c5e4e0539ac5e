"""Tests that kill mutants the rest of the suite let live: each pins down a behaviour of the optimizer,
its schedule, its fp8 blocks, the data loader, RoPE, RMSNorm or the FLOP count against an independent
reference (torch's own schedulers and AdamW, a naive formula, transformers), where a small change of
the source (an off-by-one, a dropped term, a swapped clamp) went unnoticed."""


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


# ------------------------------------------------------------------------------- optimizers

from moefold.config import OptimConfig  # noqa: E402
from moefold.optim.adamw import build_optimizer  # noqa: E402
from moefold.optim.blocks import (  # noqa: E402
    BLOCK,
    FP8,
    FP8_MAX,
    dequantize_fp8,
    dequantize_fp8_many,
    pieces_hold_whole_blocks,
    quantize_fp8,
    quantize_fp8_many,
    row_blocks,
)
from moefold.optim.precision import PrecisionAwareAdamW, join_fp32, split_fp32  # noqa: E402


@pytest.mark.parametrize("o", [OptimConfig(), OptimConfig(exp_avg_dtype="bf16")], ids=["torch", "precision"])
def test_build_optimizer_takes_train_eps_betas_and_lr(o):
    """train.eps reaches the optimizer (the default 1e-8 is also both optimizers' own default)."""
    model = torch.nn.Linear(4, 4)
    t = TrainConfig(lr=2e-3, eps=1e-3, beta1=0.8, beta2=0.9, weight_decay=0.05)
    opt = build_optimizer(model, t, torch.device("cpu"), o)
    for group in opt.param_groups:
        assert (group["lr"], group["eps"], group["betas"]) == (2e-3, 1e-3, (0.8, 0.9))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_fp32_precision_adamw_is_torchs_adamw_bit_for_bit_with_a_large_eps(foreach):
    """As documented: fp32 everything is bit-identical to torch.optim.AdamW(foreach=False), here
    with an eps large enough that where it is added (after sqrt(v) / sqrt(1 - beta2^t)) shows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen) * 1e-2
    p, ref_p = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    hp = {"betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1}
    opt = PrecisionAwareAdamW([p], lr=1e-2, foreach=foreach, **hp)
    ref = torch.optim.AdamW([ref_p], lr=1e-2, foreach=False, **hp)
    for lr in (1e-2, 3e-2, 5e-3, 2e-2):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = lr
        g = torch.randn(6, 40, generator=gen) * torch.logspace(-5, 0, 40)
        p.grad, ref_p.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert torch.equal(p.detach(), ref_p.detach())


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_fp8_sqrt_v_is_never_rounded_to_zero(foreach):
    """One element with a huge gradient once (its v stays large, its m decays), beside one with a
    small steady gradient that then stops: the small one's sqrt(v) is 1e-7 of its block's maximum,
    under e4m3's smallest subnormal. Stored as zero, the step after its gradient stops divided its
    momentum by eps alone (an update of 10^4 · lr); clamped to the smallest subnormal, no step
    moves an element by more than AdamW's usual ~lr (the overestimated v only shrinks it)."""
    lr, hp = 1e-3, {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PrecisionAwareAdamW([p], lr=lr, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8", foreach=foreach, **hp)
    grads = [torch.tensor([1e4, 0.0])] + [torch.tensor([0.0, 1e-3])] * 40 + [torch.tensor([0.0, 0.0])]
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        assert (p.detach() - before).abs().max() <= 3 * lr
    assert opt.state[p]["exp_avg_sq"].float()[1] > 0


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_an_all_zero_fp8_block_stays_zero_and_finite(foreach):
    """A parameter whose gradient is zero (an unused expert) with fp8 moments: its blocks' maxima
    are zero, their scales the smallest fp32, never 0/0; it moves only by weight decay, as in
    torch's AdamW."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    p, ref_p = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = PrecisionAwareAdamW([p], exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8", foreach=foreach, **hp)
    ref = torch.optim.AdamW([ref_p], foreach=False, **hp)
    for _ in range(2):
        p.grad, ref_p.grad = torch.zeros_like(x), torch.zeros_like(x)
        opt.step()
        ref.step()
    assert torch.equal(p.detach(), ref_p.detach())
    b = row_blocks(p)
    for key in ("exp_avg", "exp_avg_sq"):  # sqrt(v) at its floor: a subnormal times the tiny scale
        moment = dequantize_fp8(opt.state[p][key], opt.state[p][f"{key}_scale"], b)
        assert torch.isfinite(moment).all() and moment.abs().max() < 1e-40


def test_fp8_blocks_use_e4m3s_whole_range_and_dequantize_as_q_times_scale():
    """Each block's largest magnitude becomes ±448 (scale = amax / 448, the naive recipe: a smaller
    divisor wastes a binade); dequantizing is q · the block's scale, one and many at a time."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
    b = row_blocks(x)
    for q, scale in (quantize_fp8(x, b), tuple(t[0] for t in quantize_fp8_many([x], [b]))):
        blocks = [x[:, i:i + BLOCK] for i in range(0, 300, BLOCK)]
        amax = torch.stack([blk.abs().amax(dim=1) for blk in blocks], dim=1)
        assert torch.equal(scale, amax / FP8_MAX)
        q_blocks = [q[:, i:i + BLOCK].float() for i in range(0, 300, BLOCK)]
        assert all(torch.equal(qb.abs().amax(dim=1), torch.full((5,), FP8_MAX)) for qb in q_blocks)
        naive = torch.cat([qb * scale[:, j:j + 1] for j, qb in enumerate(q_blocks)], dim=1)
        assert torch.equal(dequantize_fp8(q, scale, b), naive)
        assert torch.equal(dequantize_fp8_many([q], [scale], [b])[0], naive)
    assert q.dtype == FP8


@pytest.mark.parametrize("cols", [1, 100, 128, 130, 256, 300, 512, 1000])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_pieces_hold_whole_blocks_as_a_naive_split_says(cols, ranks):
    """torch's Shard pieces of ceil(cols / ranks) columns: each (non-empty) piece starts at a block
    boundary and ends at one or at the row's end."""
    piece = -(-cols // ranks)
    bounds = [(s, min(s + piece, cols)) for s in range(0, cols, piece)]
    naive = all(s % BLOCK == 0 and (e % BLOCK == 0 or e == cols) for s, e in bounds)
    assert pieces_hold_whole_blocks(cols, ranks) == naive


def test_split_fp32_rounds_ties_away_from_zero_and_join_undoes_it():
    """bf16 high half rounded to nearest, ties (low half 0x8000) away from zero, against a naive
    rounding in float64; joining gives back every bit, ties included."""
    gen = torch.Generator().manual_seed(0)
    hi = torch.randint(0, 2 ** 16, (4000,), generator=gen, dtype=torch.int64)
    exponent = (hi >> 7) & 0xFF
    hi = hi[(exponent > 0) & (exponent < 0xFE)]  # normal values whose round-up stays finite
    lo = torch.randint(0, 2 ** 16, hi.shape, generator=gen, dtype=torch.int64)
    lo[::3] = 0x8000
    lo[1::7] = 0
    bits = (hi << 16) | lo
    x = (bits - (bits >= 2 ** 31).long() * 2 ** 32).to(torch.int32).view(torch.float32)
    p_bf16, rem = split_fp32(x)
    assert torch.equal(join_fp32(p_bf16, rem).view(torch.int32), x.view(torch.int32))
    down = (bits & ~0xFFFF)
    down = (down - (down >= 2 ** 31).long() * 2 ** 32).to(torch.int32).view(torch.float32).double()
    ulp = (torch.frexp(down)[1].double() - 8).exp2() * down.sign()  # a bf16 ulp, toward larger |x|
    up = down + ulp
    diff_down, diff_up = (x.double() - down).abs(), (up - x.double()).abs()
    want = torch.where(diff_up <= diff_down, up, down)  # tie: up, away from zero
    assert torch.equal(p_bf16.double(), want)


# ------------------------------------------------------------------------------------- YaRN

from moefold.models.rope import RopeScaling, rope_cos_sin, yarn_attention_factor  # noqa: E402

YARN_CASES = [  # factor, original_max_len, beta_fast, beta_slow, mscale, mscale_all_dim, head_dim
    (4.0, 64, 32.0, 1.0, 1.0, 0.0, 64),
    (40.0, 4096, 32.0, 1.0, 1.0, 1.0, 64),  # DeepSeek-V3's
    (8.0, 256, 8.0, 2.0, 0.707, 1.0, 32),
    (4.0, 64, 32.0, 1.0, 0.0, 1.0, 16),  # mscale 0: the paper's factor, not 1 / mscale_all_dim's
    (4.0, 64, 32.0, 11.0, 1.0, 0.0, 16),  # both corrections clamped to index 0: low = high
    (4.0, 2 ** 20, 1024.0, 1.0, 1.0, 0.0, 16),  # low 4, high 11: past Dh/2 - 1, clamped at Dh - 1 only
]


@pytest.mark.parametrize("case", YARN_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_yarn_tables_are_transformers_yarn(case):
    """cos/sin tables from transformers' own _compute_yarn_parameters (inverse frequencies and
    attention factor), bit for bit as rope.py's docstring claims."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    factor, original, fast, slow, mscale, mscale_all_dim, head_dim = case
    scaling = RopeScaling(factor, original, beta_fast=fast, beta_slow=slow, mscale=mscale,
                          mscale_all_dim=mscale_all_dim)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": fast, "beta_slow": slow, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = Qwen3MoeConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                            rope_parameters=rope, max_position_embeddings=int(factor * original))
    inv_freq_half, attention_factor = _compute_yarn_parameters(config)
    assert yarn_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
    angles = torch.outer(torch.arange(300, dtype=torch.float32), inv_freq_half)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = rope_cos_sin(300, head_dim, 10000.0, scaling=scaling)
    assert torch.equal(cos, angles.cos() * attention_factor)
    assert torch.equal(sin, angles.sin() * attention_factor)


# ----------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_the_naive_formula_with_eps_inside_the_root(dtype):
    """x / sqrt(mean(x²) + eps) · w in float64, at magnitudes where eps matters (mean(x²) near eps)
    and where it does not; the result rounded once to the input's dtype."""
    from moefold.models.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen) * torch.tensor([1e-4, 1e-3, 1.0, 30.0])[:, None]
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    x = x.to(dtype)
    xd = x.double()
    want = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight.double()
    got = norm(x)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
