"""The optimizers against a textbook AdamW written here in float64 (Loshchilov & Hutter's decoupled
weight decay, p ← p − lr·wd·p; Adam's bias-corrected moments; eps added to sqrt(v̂)): torch's AdamW
as build_optimizer builds it and PrecisionAwareAdamW in every precision, per param group, with the
lr changing between steps and parameters without a gradient on some steps. Low-precision states
are checked one step at a time from their own dequantized values, within their dtype's rounding."""

import pytest
import torch

from moefold.config import TrainConfig
from moefold.optim.adamw import build_optimizer, param_groups
from moefold.optim.blocks import FP8, dequantize_fp8, row_blocks
from moefold.optim.precision import PrecisionAwareAdamW, join_fp32

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
LRS = [3e-3, 1e-2, 4e-3, 2.5e-2, 1e-3, 7e-3]  # a new lr every step


class TextbookAdamW:
    """AdamW in float64, one tensor, in the paper's notation."""

    def __init__(self, x: torch.Tensor, weight_decay: float):
        self.x, self.wd, self.t = x.double().clone(), weight_decay, 0
        self.m, self.v = torch.zeros_like(self.x), torch.zeros_like(self.x)

    def step(self, g: torch.Tensor, lr: float) -> None:
        (b1, b2), g = BETAS, g.double()
        self.t += 1
        self.x = self.x - lr * self.wd * self.x
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        m_hat, v_hat = self.m / (1 - b1 ** self.t), self.v / (1 - b2 ** self.t)
        self.x = self.x - lr * m_hat / (v_hat.sqrt() + EPS)


def _model() -> torch.nn.Module:
    """A matrix (decayed), a bias and a norm weight (not), an embedding (not)."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(16, 24)
    model.proj = torch.nn.Linear(24, 130)
    model.norm = torch.nn.LayerNorm(130)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    return model


def _gradients(model, steps: int) -> list[dict[str, torch.Tensor | None]]:
    """Per step, a gradient per parameter (rows of very different sizes); the bias has none on
    the third step, as a parameter the step leaves alone."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        out.append({name: None if name == "proj.bias" and step == 2 else
                    torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], *[1] * (p.dim() - 1),
                                                                     generator=gen).mul(16).sub(8).exp2()
                    for name, p in model.named_parameters()})
    return out


DECAYED = {"tok_embeddings.weight": False, "proj.weight": True, "proj.bias": False, "norm.weight": False,
           "norm.bias": False}


@pytest.mark.parametrize("kind", ["torch-adamw", "precision-fp32", "precision-fp32-loop"])
def test_fp32_optimizers_follow_the_textbook_adamw(kind):
    """Decay on the matrix only, bias correction counted per parameter (the bias skips a step),
    the scheduled lr of each step: within fp32's rounding of the fp64 trajectory."""
    model = _model()
    if kind == "torch-adamw":
        opt = build_optimizer(model, TrainConfig(lr=1.0, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS),
                              torch.device("cpu"))
    else:
        opt = PrecisionAwareAdamW(param_groups(model, WD), lr=1.0, betas=BETAS, eps=EPS,
                                  foreach=kind == "precision-fp32")
    assert {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]} == \
        {id(p): WD if DECAYED[n] else 0.0 for n, p in model.named_parameters()}
    refs = {n: TextbookAdamW(p.detach(), WD if DECAYED[n] else 0.0) for n, p in model.named_parameters()}
    for lr, grads in zip(LRS, _gradients(model, len(LRS))):
        for group in opt.param_groups:
            group["lr"] = lr  # as the schedule sets it
        for name, p in model.named_parameters():
            p.grad = grads[name]
            if grads[name] is not None:
                refs[name].step(grads[name], lr)
        opt.step()
        for name, p in model.named_parameters():
            x = refs[name].x
            torch.testing.assert_close(p.detach().double(), x, rtol=0, atol=1e-6 * (1 + x.abs().max().item()))


# ------------------------------------------------------------------ low precision, one step at a time

VARIANTS = [{"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
            {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"},
            {"master": "bf16"}, {"master": "bf16+remainder"},
            {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16", "master": "bf16+remainder"},
            {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8", "master": "bf16+remainder"}]


def _fp32_master(p, state) -> torch.Tensor:
    if "master_remainder" in state:
        return join_fp32(p.detach(), state["master_remainder"])
    return p.detach().float()


def _moment(p, state, key) -> tuple[torch.Tensor, torch.Tensor]:
    """(the moment as stored, in fp64; the bound of its storage rounding): fp32 exact, bf16 half an
    ulp, e4m3 half an ulp of its 3 mantissa bits or half a subnormal step of its block's scale
    (sqrt(v): a whole step, the floor that keeps it from zero)."""
    t = state[key]
    if t.dtype != FP8:
        x = t.double()
        rel = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}[t.dtype]  # unit roundoffs
        return x, rel * x.abs()
    scale = state[f"{key}_scale"]
    x = dequantize_fp8(t, scale, row_blocks(p)).double()
    per_elem = scale.double().repeat_interleave(128, dim=-1)[..., :x.shape[-1]].reshape(x.shape)
    slack = 2.0 ** -4 * x.abs() + (2.0 ** -9 if key == "exp_avg_sq" else 2.0 ** -10) * per_elem
    return (x.square(), 2 * x.abs() * slack + slack ** 2) if key == "exp_avg_sq" else (x, slack)


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_each_low_precision_step_is_adamw_from_its_stored_state(options):
    """From the state a step reads (dequantized), the fp64 AdamW step; what it stores is that within
    its dtype's rounding; the master within fp32's (bf16: half a bf16 ulp)."""
    model = _model()
    opt = PrecisionAwareAdamW(param_groups(model, WD), lr=1.0, betas=BETAS, eps=EPS, **options)
    (b1, b2), params = BETAS, dict(model.named_parameters())
    for t, (lr, grads) in enumerate(zip(LRS, _gradients(model, len(LRS))), start=1):
        for group in opt.param_groups:
            group["lr"] = lr
        before = {}
        for name, p in params.items():
            p.grad = None if grads[name] is None else grads[name].to(p.dtype)
            s = opt.state[p]
            before[name] = (_fp32_master(p, s).double(), _moment(p, s, "exp_avg")[0],
                            _moment(p, s, "exp_avg_sq")[0], s["step"].item() + 1)
        opt.step()
        for name, p in params.items():
            if p.grad is None:
                continue
            x, m, v, k = before[name]
            g, wd = p.grad.double(), WD if DECAYED[name] else 0.0
            sizes = {"exp_avg": b1 * m.abs() + (1 - b1) * g.abs(), "exp_avg_sq": b2 * v + (1 - b2) * g * g}
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            update = (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + EPS)
            x = x * (1 - lr * wd) - lr * update
            s = opt.state[p]
            for key, want in (("exp_avg", m), ("exp_avg_sq", v)):
                got, slack = _moment(p, s, key)
                err = (got - want).abs() - slack - 1e-6 * sizes[key]  # fp32's sums of the terms
                assert err.max() <= 0, f"step {t} {name} {key}: {err.max().item():.3g} beyond its rounding"
            rounding = 2.0 ** -8 if options.get("master") == "bf16" else 0.0
            x_err = (_fp32_master(p, s).double() - x).abs() - rounding * x.abs()
            assert x_err.max() <= 4e-7 * (x.abs() + lr * update.abs()).max(), f"step {t} {name} master"


@pytest.mark.parametrize("options", [{}, *VARIANTS], ids=lambda o: "-".join(f"{v}" for v in o.values()) or "fp32")
def test_an_empty_parameter_first_in_its_group_changes_nothing(options):
    """Zero-element parameters (torch's AdamW takes them) at the head of a param group: the foreach
    path's chunking opened no chunk for the first (IndexError at the first step). The group steps
    as without them, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen)
    with_empty = [torch.nn.Parameter(t) for t in (torch.zeros(0), x.clone(), torch.zeros(2, 0))]
    alone = [torch.nn.Parameter(x.clone())]
    opts = [PrecisionAwareAdamW(ps, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD, **options)
            for ps in (with_empty, alone)]
    ref = TextbookAdamW(x, WD)
    for _ in range(3):
        g = torch.randn(3, 5, generator=gen)
        for p in with_empty:
            p.grad = g.to(p.dtype) if p.numel() else torch.zeros_like(p)
        alone[0].grad = g.to(alone[0].dtype)
        for opt in opts:
            opt.step()
        ref.step(g.to(alone[0].dtype), 1e-2)
    assert with_empty[0].numel() == with_empty[2].numel() == 0
    masters = [_fp32_master(p, opt.state[p]) for p, opt in ((with_empty[1], opts[0]), (alone[0], opts[1]))]
    assert torch.equal(masters[0], masters[1])
    if not options:
        torch.testing.assert_close(masters[0].double(), ref.x, rtol=0, atol=1e-6)
