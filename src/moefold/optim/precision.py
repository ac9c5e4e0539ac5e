"""Precision-aware AdamW: moments in fp32, bf16 or fp8, master weights in fp32, bf16, or bf16
parameters plus int16 remainders that rebuild the exact fp32 master (TransformerEngine's FusedAdam
`store_param_remainders`, used by Megatron-Core's `--use-precision-aware-optimizer`).

Every step dequantizes to fp32, runs the AdamW arithmetic of `torch.optim.AdamW` (decoupled weight
decay) in fp32, and stores the results back in their own dtypes. With fp32 everything it is
bit-identical to `torch.optim.AdamW(foreach=False)`. The default `foreach=True` path updates a
param group with torch._foreach_* ops and quantises all its fp8 moments in one batch; on the CPU it
is bit-identical to the per-parameter loop (`foreach=False`, the reference).

State per parameter (all allocated at construction, so a checkpoint template is complete and
`torch.distributed.checkpoint.state_dict.get_state_dict` sees them as they are):
  step                    fp32 scalar on the CPU (as torch AdamW)
  exp_avg, exp_avg_sq     the parameter's shape, in fp32, bf16 or float8_e4m3fn
  exp_avg_scale,          fp8 only: fp32 scales [..., ceil(last dim / 128)], one per block of 128
  exp_avg_sq_scale        elements along the last dimension (optim/blocks.py)
  master_remainder        "bf16+remainder" only: int16, the parameter's shape

Sharded parameters (DTensors: FSDP2, TP, EP) are updated on their local shards, which is exact for
this element-wise update; every state is a DTensor with the parameter's mesh and placements (the
fp8 scales split with a last dimension split at block boundaries, replicated where the split cuts
blocks: optim/blocks.py), so DCP saves whole states by name and resumes them under any other
layout, in their own dtypes.

fp8 second moment: exp_avg_sq holds sqrt(v) in e4m3 with per-block scales, not v. sqrt halves the
dynamic range in log space, so e4m3 (2^-9..448 within a block) spans 2^35 of v against e5m2's 2^32,
with the same relative error on the Adam denominator sqrt(v) (2^-4); and nonzero sqrt(v) is never
rounded to zero (it is clamped to the smallest subnormal), which would otherwise blow an update up
to m/eps. Overestimating a tiny v only shrinks that element's step.

`fused=True` updates CUDA parameters by one Triton kernel pass each (optim/fused.py), with the
foreach path's arithmetic; fp8 moments there too, except in pieces whose last dimension is split
across a block (the foreach path completes those blocks' maxima over the ranks). Not here yet:
stochastic rounding.
"""

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moefold.optim.blocks import (
    FP8,
    FP8_MIN_SUBNORMAL,
    RowBlocks,
    dequantize_fp8,
    dequantize_fp8_many,
    quantize_fp8,
    quantize_fp8_many,
    row_blocks,
    scale_like,
)
from moefold.optim.fused import (
    HAS_TRITON,
    fused_adamw_step_,
    fused_supported,
    triton_available,
)
from moefold.parallel.local import local_tensor

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}
MASTER_MODES = ("fp32", "bf16", "bf16+remainder")
MOMENTS = ("exp_avg", "exp_avg_sq")
FOREACH_ELEMENTS = 2 ** 25
"""Local elements updated by one foreach call (a piece's size counted alike on every rank,
`_piece_elements`): bounds its fp32 working copies (master, moments, gradient, denominator: about
20 bytes per element, 640 MiB) whatever the model's size."""


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor sharded like `p` (itself when `p` is a plain tensor)."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _piece_elements(p: torch.Tensor) -> int:
    """Elements of a piece of `p`, the same number on every rank: its size over the pieces its
    placements cut it into (rounded up), not the local size, which uneven shards make differ."""
    if not isinstance(p, DTensor):
        return p.numel()
    pieces = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if not pl.is_replicate())
    return -(-p.numel() // pieces)


def _chunks(params: list[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of parameters of at most `max_elements` elements a piece (a larger
    parameter alone). Every rank cuts a group at the same parameters: a chunk's fp8 blocks that
    split their last dimension complete their maxima in one collective over the ranks."""
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        n = _piece_elements(p)
        if not chunks or size + n > max_elements:  # the first opens one, even when empty
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += n
    return chunks


def replace_local(p: nn.Parameter, local: torch.Tensor) -> None:
    """Give `p` new (differently typed) values, keeping the Parameter object that modules, FSDP
    and the optimizer refer to. A DTensor's dtype is fixed, so its whole tensor is swapped."""
    if not isinstance(p, DTensor):
        p.data = local
        return
    torch.utils.swap_tensors(p, nn.Parameter(_like(p, local), requires_grad=p.requires_grad))


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


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's checks: a beta of 1 zeroes a bias correction (NaN weights at the first
    step, or a ZeroDivisionError), a negative lr, eps or weight decay would step uphill or grow."""
    ranges = (("lr", lr, "lr >= 0"), ("betas[0]", betas[0], "0 <= betas[0] < 1"),
              ("betas[1]", betas[1], "0 <= betas[1] < 1"), ("eps", eps, "eps >= 0"),
              ("weight_decay", weight_decay, "weight_decay >= 0"))
    for name, value, allowed in ranges:
        ok = 0.0 <= value < 1.0 if name.startswith("betas") else value >= 0.0  # NaN fails both
        if not ok:
            raise ValueError(f"{name}={value}; allowed: {allowed}")


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments and master weights in chosen precisions.

    exp_avg_dtype, exp_avg_sq_dtype: "fp32", "bf16" or "fp8" (e4m3, per-block scaled).
    master: "fp32" (parameters are fp32); "bf16" (parameters are bf16, the fp32 update is rounded
    to nearest into them); "bf16+remainder" (bf16 parameters plus an int16 remainder in the state
    that rebuilds the exact fp32 master). In the bf16 modes fp32 parameters are cast to bf16 in
    place at construction (the remainder keeps their low bits, so nothing is lost); under FSDP2
    build it before the first forward, which fixes the dtype FSDP gathers in.
    foreach: one torch._foreach_* update per param group (False: the per-parameter reference).
    fused: one Triton kernel pass per parameter for the groups on CUDA (optim/fused.py: needs
    Triton); it takes precedence over foreach there.

    grad_multiplier: None, or an fp32 one-element tensor that multiplies every gradient of the next
    step (the clip coefficient, optim.adamw.ClipInFusedPrecisionAdamW): the kernel applies it as it
    reads the gradients, other paths scale them in place first; either way they are left scaled.
    The step consumes it (sets it back to None).
    """

    grad_multiplier: torch.Tensor | None = None

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, exp_avg_dtype: str = "fp32",
                 exp_avg_sq_dtype: str = "fp32", master: str = "fp32", foreach: bool = True,
                 fused: bool = False):
        for name, value in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if value not in MOMENT_DTYPES:
                raise ValueError(f"{name}={value!r}; allowed: {', '.join(MOMENT_DTYPES)}")
        if master not in MASTER_MODES:
            raise ValueError(f"master={master!r}; allowed: {', '.join(MASTER_MODES)}")
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype,
                    "master": master, "foreach": foreach, "fused": fused}
        super().__init__(params, defaults)
        self._check_fused()  # before _init_state recasts any parameter
        self._row_blocks: dict[torch.Tensor, RowBlocks] = {}  # fp8 block layout of each shard
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and after construction (which initialises its own groups) the new group's
        states too: the step read them (KeyError: 'step'). A group torch or the checks refuse is
        not added, and no parameter of it is recast."""
        super().add_param_group(param_group)
        if not hasattr(self, "_row_blocks"):  # called by torch's __init__
            return
        group = self.param_groups[-1]
        try:
            for key, allowed in (("exp_avg_dtype", MOMENT_DTYPES), ("exp_avg_sq_dtype", MOMENT_DTYPES),
                                 ("master", MASTER_MODES)):
                if group[key] not in allowed:
                    raise ValueError(f"{key}={group[key]!r}; allowed: {', '.join(allowed)}")
            self._check_fused()
        except ValueError:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            self._init_state(p, group)

    def _check_fused(self) -> None:
        for i, group in enumerate(self.param_groups):
            if not group["fused"]:
                continue
            if not triton_available():
                raise ValueError(f"fused=True needs Triton and a CUDA device (here: triton "
                                 f"{'installed' if HAS_TRITON else 'not installed'}, "
                                 f"{torch.cuda.device_count()} CUDA devices); use fused=False")
            moments = group["exp_avg_dtype"], group["exp_avg_sq_dtype"]
            if not fused_supported(*moments):
                raise ValueError(f"fused=True does not handle param group {i}'s exp_avg_dtype="
                                 f"{moments[0]!r}, exp_avg_sq_dtype={moments[1]!r}; use fused=False")

    def _init_state(self, p: nn.Parameter, group: dict) -> None:
        want = torch.float32 if group["master"] == "fp32" else torch.bfloat16
        if p.dtype not in (torch.float32, want):
            raise ValueError(f"master={group['master']!r} needs fp32 or {want} parameters, got {p.dtype}")
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if group["master"] == "bf16+remainder":
            x = local_tensor(p).detach().float()  # bf16 parameters start with a zero remainder (exact)
            hi, remainder = split_fp32(x)
            replace_local(p, hi)
            state["master_remainder"] = _like(p, remainder)
        elif p.dtype != want:
            replace_local(p, local_tensor(p).detach().to(want))
        for key in MOMENTS:
            dtype = MOMENT_DTYPES[group[f"{key}_dtype"]]
            state[key] = torch.zeros_like(p, dtype=dtype)
            if dtype == FP8:
                state[f"{key}_scale"] = scale_like(p)
                self._row_blocks[p] = row_blocks(p)

    # -------------------------------------------------------------- load / store one state

    def _load_moment(self, p: torch.Tensor, state: dict, key: str) -> torch.Tensor:
        """fp32 view of a moment's shard; the state itself when it is fp32 (updated in place)."""
        t = local_tensor(state[key])
        if t.dtype != FP8:
            return t.float()  # no copy for fp32
        x = dequantize_fp8(t, local_tensor(state[f"{key}_scale"]), self._row_blocks[p])
        return x.square() if key == "exp_avg_sq" else x  # fp8 exp_avg_sq holds sqrt(v)

    def _store_moment(self, p: torch.Tensor, state: dict, key: str, x: torch.Tensor) -> None:
        t = local_tensor(state[key])
        if t.dtype == FP8:
            if key == "exp_avg_sq":  # store sqrt(v), never rounded to zero
                q, scale = quantize_fp8(x.sqrt(), self._row_blocks[p], floor=FP8_MIN_SUBNORMAL)
            else:
                q, scale = quantize_fp8(x, self._row_blocks[p])
            t.copy_(q)
            scale_t = local_tensor(state[f"{key}_scale"])
            scale_t.copy_(scale.view_as(scale_t))
        elif t is not x:
            t.copy_(x)  # round to nearest

    @staticmethod
    def _load_master(p: torch.Tensor, state: dict) -> torch.Tensor:
        if "master_remainder" in state:
            return join_fp32(local_tensor(p).detach(), local_tensor(state["master_remainder"]))
        return local_tensor(p).detach().float()  # p itself when fp32

    @staticmethod
    def _store_master(p: torch.Tensor, state: dict, x: torch.Tensor) -> None:
        local = local_tensor(p).detach()
        if "master_remainder" in state:
            hi, rem = split_fp32(x)
            local.copy_(hi)
            local_tensor(state["master_remainder"]).copy_(rem)
        elif x is not local:
            local.copy_(x)

    # ------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        multiplier = self.grad_multiplier
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group.get("fused") and local_tensor(params[0]).is_cuda:
                whole = [self._whole_blocks(p) for p in params]
                self._step_fused([p for p, w in zip(params, whole) if w], group, multiplier)
                params = [p for p, w in zip(params, whole) if not w]  # fp8 blocks split over ranks
                if not params:
                    continue
            if multiplier is not None:  # as scale_gradients (parallel/data.py)
                grads = [local_tensor(p.grad) for p in params]
                torch._foreach_mul_(grads, multiplier.to(grads[0].device, grads[0].dtype))
            if group.get("foreach", True):  # absent in checkpoints of older versions
                for chunk in _chunks(params, FOREACH_ELEMENTS):
                    self._step_group(chunk, group)
            else:
                for p in params:
                    self._step_param(p, group, self.state[p])
        self.grad_multiplier = None  # it scaled this step's gradients only
        return loss

    def _step_fused(self, params: list[torch.Tensor], group: dict, multiplier: torch.Tensor | None) -> None:
        """`_step_group`'s arithmetic, one Triton kernel pass per parameter (optim/fused.py), for
        pieces that hold their fp8 blocks whole (step() leaves the others, whose blocks' maxima need
        an all-reduce, to the foreach path)."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            state["step"] += 1
            remainder, scales = state.get("master_remainder"), [state.get(f"{key}_scale") for key in MOMENTS]
            fused_adamw_step_(local_tensor(p).detach(), local_tensor(p.grad), local_tensor(state["exp_avg"]),
                              local_tensor(state["exp_avg_sq"]),
                              None if remainder is None else local_tensor(remainder), lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=wd,
                              step=int(state["step"].item()),  # a CPU tensor: no device sync
                              grad_multiplier=multiplier,
                              **{f"{key}_scale": None if scale is None else local_tensor(scale)
                                 for key, scale in zip(MOMENTS, scales)})

    def _whole_blocks(self, p: torch.Tensor) -> bool:
        """Whether every fp8 scaling block of p's piece is whole in it (true without fp8 moments)."""
        b = self._row_blocks.get(p)
        return b is None or (not b.groups and b.lead == 0 and b.local_blocks == b.n_blocks)

    def _step_param(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """The arithmetic of torch's `_single_tensor_adam` (decoupled weight decay), in fp32."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"].item()  # a CPU tensor: no device sync
        grad = local_tensor(p.grad).float()
        x = self._load_master(p, state)
        exp_avg, exp_avg_sq = self._load_moment(p, state, "exp_avg"), self._load_moment(p, state, "exp_avg_sq")

        x.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
        x.addcdiv_(exp_avg, denom, value=-step_size)

        self._store_moment(p, state, "exp_avg", exp_avg)
        self._store_moment(p, state, "exp_avg_sq", exp_avg_sq)
        self._store_master(p, state, x)

    def _step_group(self, params: list[torch.Tensor], group: dict) -> None:
        """`_step_param` for all of a group's parameters at once (same ops, same order)."""
        if not params:
            return
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        counts = [s.item() for s in steps]  # CPU tensors: no device sync
        grads = [local_tensor(p.grad).float() for p in params]
        xs = self._load_masters(params, states)
        exp_avgs, exp_avg_sqs = (self._load_moments(params, states, key) for key in MOMENTS)

        torch._foreach_mul_(xs, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [(1 - beta2 ** k) ** 0.5 for k in counts])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(xs, exp_avgs, denoms, [-(lr / (1 - beta1 ** k)) for k in counts])

        self._store_moments(params, states, "exp_avg", exp_avgs)
        self._store_moments(params, states, "exp_avg_sq", exp_avg_sqs)
        self._store_masters(params, states, xs)

    # ------------------------------------------------- load / store a group's states at once

    def _load_moments(self, params, states, key: str) -> list[torch.Tensor]:
        ts = [local_tensor(s[key]) for s in states]
        if ts[0].dtype != FP8:  # one dtype per group
            return [t.float() for t in ts]
        xs = dequantize_fp8_many(ts, [local_tensor(s[f"{key}_scale"]) for s in states],
                                 [self._row_blocks[p] for p in params])
        if key == "exp_avg_sq":
            torch._foreach_mul_(xs, xs)  # x.square(): the same product
        return xs

    def _store_moments(self, params, states, key: str, xs: list[torch.Tensor]) -> None:
        ts = [local_tensor(s[key]) for s in states]
        if ts[0].dtype == torch.float32:
            return  # updated in place
        if ts[0].dtype != FP8:
            torch._foreach_copy_(ts, xs)
            return
        bs = [self._row_blocks[p] for p in params]
        if key == "exp_avg_sq":
            qs, scales = quantize_fp8_many(torch._foreach_sqrt(xs), bs, floor=FP8_MIN_SUBNORMAL)
        else:
            qs, scales = quantize_fp8_many(xs, bs)
        torch._foreach_copy_(ts, qs)
        scale_ts = [local_tensor(s[f"{key}_scale"]) for s in states]
        torch._foreach_copy_(scale_ts, [s.view_as(t) for s, t in zip(scales, scale_ts)])

    @staticmethod
    def _load_masters(params, states) -> list[torch.Tensor]:
        locals_ = [local_tensor(p).detach() for p in params]
        if "master_remainder" not in states[0]:
            return [t.float() for t in locals_]  # the parameters themselves when fp32
        rems = [local_tensor(s["master_remainder"]) for s in states]
        flat = join_fp32(torch.cat([t.reshape(-1) for t in locals_]), torch.cat([r.reshape(-1) for r in rems]))
        return [x.view_as(t) for x, t in zip(flat.split([t.numel() for t in locals_]), locals_)]

    @staticmethod
    def _store_masters(params, states, xs: list[torch.Tensor]) -> None:
        locals_ = [local_tensor(p).detach() for p in params]
        if "master_remainder" not in states[0]:
            if locals_[0].dtype != torch.float32:
                torch._foreach_copy_(locals_, xs)  # round to nearest
            return
        hi, rem = split_fp32(torch.cat([x.reshape(-1) for x in xs]))
        sizes = [t.numel() for t in locals_]
        torch._foreach_copy_(locals_, [h.view_as(t) for h, t in zip(hi.split(sizes), locals_)])
        rems = [local_tensor(s["master_remainder"]) for s in states]
        torch._foreach_copy_(rems, [r.view_as(t) for r, t in zip(rem.split(sizes), rems)])

    # ---------------------------------------------------------------------------- loading

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch, but keeps each state tensor's own dtype: torch casts floating state to the
        parameter's dtype (`Optimizer._process_value_according_to_param_policy`), which would
        widen fp8 moments and corrupt int16 remainders through bf16. Each group keeps its own
        `fused`: the kernel is this process's choice (its device, Triton), not the saver's. The
        step counts stay CPU tensors, as built."""
        fused = [group.get("fused", False) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, f in zip(self.param_groups, fused):
            group["fused"] = f
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key, value in saved.items():
                if key == "step":  # on the CPU (torch moves it to a fused saver's device): no sync to read it
                    self.state[p][key] = torch.as_tensor(value).to("cpu", torch.float32, copy=True)
                elif isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
