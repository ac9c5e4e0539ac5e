"""Precision-aware AdamW: moments in fp32, bf16 or fp8, master weights in fp32, bf16, or bf16
parameters plus int16 remainders that rebuild the exact fp32 master (TransformerEngine's FusedAdam
`store_param_remainders`, used by Megatron-Core's `--use-precision-aware-optimizer`).

Every step dequantizes to fp32, runs the AdamW arithmetic of `torch.optim.AdamW` (single-tensor
path, decoupled weight decay) in fp32, and stores the results back in their own dtypes. With fp32
everything it is bit-identical to `torch.optim.AdamW(foreach=False)`.

State per parameter (all allocated at construction, so a checkpoint template is complete and
`torch.distributed.checkpoint.state_dict.get_state_dict` sees them as they are):
  step                    fp32 scalar on the CPU (as torch AdamW)
  exp_avg, exp_avg_sq     the parameter's shape, in fp32, bf16 or float8_e4m3fn
  exp_avg_scale,          fp8 only: one fp32 scale per block of BLOCK elements (flattened order)
  exp_avg_sq_scale
  master_remainder        "bf16+remainder" only: int16, the parameter's shape

fp8 second moment: exp_avg_sq holds sqrt(v) in e4m3 with per-block scales, not v. sqrt halves the
dynamic range in log space, so e4m3 (2^-9..448 within a block) spans 2^35 of v against e5m2's 2^32,
with the same relative error on the Adam denominator sqrt(v) (2^-4); and nonzero sqrt(v) is never
rounded to zero (it is clamped to the smallest subnormal), which would otherwise blow an update up
to m/eps. Overestimating a tiny v only shrinks that element's step.

Not here yet: foreach/fused multi-tensor paths (this is a per-parameter loop), stochastic rounding,
and DTensor (FSDP/TP-sharded) parameters for the fp8 block layout.
"""

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

BLOCK = 128
"""Elements per fp8 scaling block (flattened parameter order)."""
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MIN_SUBNORMAL = 2.0 ** -9

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}
MASTER_MODES = ("fp32", "bf16", "bf16+remainder")


# ------------------------------------------------------------------------------ fp8 blocks


def quantize_fp8(x: torch.Tensor, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32) → (e4m3 tensor of x's shape, fp32 scale per BLOCK elements); x ≈ q · scale.
    `floor` clamps |q| from below (see the module docstring on sqrt(v))."""
    n = x.numel()
    x_NB = F.pad(x.reshape(-1), (0, -n % BLOCK)).view(-1, BLOCK)
    scale_N = x_NB.abs().amax(dim=1).div(FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q_NB = (x_NB / scale_N[:, None]).clamp(-FP8_MAX, FP8_MAX)  # > 464 would cast to NaN
    if floor:
        q_NB = q_NB.clamp_min(floor)
    return q_NB.to(FP8).reshape(-1)[:n].view_as(x), scale_N


def dequantize_fp8(q: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    q_NB = F.pad(q.reshape(-1).float(), (0, -n % BLOCK)).view(-1, BLOCK)
    return (q_NB * scale_N[:, None]).reshape(-1)[:n].view(q.shape)


# -------------------------------------------------------------------- bf16 + int16 remainder


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 → (bf16 rounded to nearest, ties away from zero; int16 remainder). The remainder is the
    low 16 bits of x; it is negative exactly when the bf16 high half was rounded up in magnitude
    (TransformerEngine's layout). Ties cannot go to even: a tie rounded down would need +2^15."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo, hi = bits & 0xFFFF, bits >> 16
    round_up = lo >= 0x8000
    hi = (hi + round_up.long()) & 0xFFFF  # a carry into the exponent is the correct rounding
    return _as_int16(hi).view(torch.bfloat16), _as_int16(lo)


def join_fp32(p_bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The exact fp32 value that `split_fp32` split."""
    hi = p_bf16.view(torch.int16).to(torch.int64) & 0xFFFF
    rem = remainder.to(torch.int64)
    hi = (hi - (rem < 0).long()) & 0xFFFF  # undo the round-up
    bits = (hi << 16) | (rem & 0xFFFF)
    return (bits - (bits >= 2 ** 31).long() * 2 ** 32).to(torch.int32).view(torch.float32)


def _as_int16(u16: torch.Tensor) -> torch.Tensor:
    return (u16 - (u16 >= 0x8000).long() * 0x10000).to(torch.int16)


# ------------------------------------------------------------------------------ optimizer


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments and master weights in chosen precisions.

    exp_avg_dtype, exp_avg_sq_dtype: "fp32", "bf16" or "fp8" (e4m3, per-block scaled).
    master: "fp32" (parameters are fp32); "bf16" (parameters are bf16, the fp32 update is rounded
    to nearest into them); "bf16+remainder" (bf16 parameters plus an int16 remainder in the state
    that rebuilds the exact fp32 master). In the bf16 modes fp32 parameters are cast to bf16 in
    place at construction (the remainder keeps their low bits, so nothing is lost).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, exp_avg_dtype: str = "fp32",
                 exp_avg_sq_dtype: str = "fp32", master: str = "fp32"):
        for name, value in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if value not in MOMENT_DTYPES:
                raise ValueError(f"{name}={value!r}; allowed: {', '.join(MOMENT_DTYPES)}")
        if master not in MASTER_MODES:
            raise ValueError(f"master={master!r}; allowed: {', '.join(MASTER_MODES)}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                        "exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype, "master": master}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        want = torch.float32 if group["master"] == "fp32" else torch.bfloat16
        if p.dtype not in (torch.float32, want):
            raise ValueError(f"master={group['master']!r} needs fp32 or {want} parameters, got {p.dtype}")
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if group["master"] == "bf16+remainder":
            x = p.detach().float()  # bf16 parameters start with a zero remainder (exact)
            p.data, state["master_remainder"] = split_fp32(x)
        elif p.dtype != want:
            p.data = p.data.to(want)
        for key in ("exp_avg", "exp_avg_sq"):
            dtype = MOMENT_DTYPES[group[f"{key}_dtype"]]
            state[key] = torch.zeros_like(p, dtype=dtype)
            if dtype == FP8:
                state[f"{key}_scale"] = torch.ones(math.ceil(p.numel() / BLOCK), device=p.device)

    # -------------------------------------------------------------- load / store one state

    @staticmethod
    def _load_moment(state: dict, key: str) -> torch.Tensor:
        """fp32 view of a moment; the state tensor itself when it is fp32 (updated in place)."""
        t = state[key]
        if t.dtype != FP8:
            return t.float()  # no copy for fp32
        x = dequantize_fp8(t, state[f"{key}_scale"])
        return x.square() if key == "exp_avg_sq" else x  # fp8 exp_avg_sq holds sqrt(v)

    @staticmethod
    def _store_moment(state: dict, key: str, x: torch.Tensor) -> None:
        t = state[key]
        if t.dtype == FP8:
            if key == "exp_avg_sq":  # store sqrt(v), never rounded to zero
                q, scale = quantize_fp8(x.sqrt(), floor=FP8_MIN_SUBNORMAL)
            else:
                q, scale = quantize_fp8(x)
            t.copy_(q)
            state[f"{key}_scale"].copy_(scale)
        elif t is not x:
            t.copy_(x)  # round to nearest

    @staticmethod
    def _load_master(p: torch.Tensor, state: dict) -> torch.Tensor:
        if "master_remainder" in state:
            return join_fp32(p.detach(), state["master_remainder"])
        return p.detach().float()  # p itself when fp32

    @staticmethod
    def _store_master(p: torch.Tensor, state: dict, x: torch.Tensor) -> None:
        if "master_remainder" in state:
            hi, rem = split_fp32(x)
            p.detach().copy_(hi)
            state["master_remainder"].copy_(rem)
        elif x is not p:
            p.detach().copy_(x)

    # ------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group, self.state[p])
        return loss

    def _step_param(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """The arithmetic of torch's `_single_tensor_adam` (decoupled weight decay), in fp32."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"].item()  # a CPU tensor: no device sync
        grad = p.grad.float()
        x = self._load_master(p, state)
        exp_avg, exp_avg_sq = self._load_moment(state, "exp_avg"), self._load_moment(state, "exp_avg_sq")

        x.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
        x.addcdiv_(exp_avg, denom, value=-step_size)

        self._store_moment(state, "exp_avg", exp_avg)
        self._store_moment(state, "exp_avg_sq", exp_avg_sq)
        self._store_master(p, state, x)

    # ---------------------------------------------------------------------------- loading

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch, but keeps each state tensor's own dtype: torch casts floating state to the
        parameter's dtype (`Optimizer._process_value_according_to_param_policy`), which would
        widen fp8 moments and corrupt int16 remainders through bf16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    self.state[p][key] = value.to(device=p.device, copy=True)
