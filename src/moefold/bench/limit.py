"""The step limit: a training step's large kernels, each timed alone on the device, and their sum.

For the config's model at its micro-batch (T = B·S tokens), forward + backward as autograd runs
them (`torch.autograd.grad`, so no gradient accumulation kernels are timed), counted once per
micro-batch of the step (train.grad_accum; the optimizer once a step):
  output head      3 GEMMs of [T, D] × [D, V] in the compute dtype, once per head use (1 + MTP)
  core attention   the attention modules' own `core` (SDPA) on q/k/v laid out as the model lays
                   them out (GQA: [B, S, H, Dh] transposed; MLA: concatenated q/k, v a split view)
  projections      every nn.Linear of the blocks, [T, in] × [in, out], 3 GEMMs each; attention
                   projections apart from the dense MLPs, shared experts and MTP projections
  routed experts   the grouped GEMMs (gate, up, down), each with its two backward grouped GEMMs,
                   balanced routing: T·K/E rows per expert (padded to moe.pad_multiple)
  router           the router GEMM in moe.router_dtype (autocast off, as the router runs)
  optimizer        one `optimizer.step()` of the optimizer training builds (`build_optimizer`)
                   over the model's parameters, with random gradients
Norms, RoPE, activations, routing, permutation, the loss and launch gaps are not in the sum: a
real step can only come close to it. The FLOPs of the GEMM rows add up to the FLOP convention's
count (`moefold.train.flops`) less 6 · T · (the 1-D parameters: norm weights).

Recompute and offload wrappers are left out (the limit counts each kernel once). Timing: median of
`repeats` after warm-up, CUDA events on a GPU, perf_counter on the CPU (bench/timing.py).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moefold.bench.timing import median_seconds, synchronize
from moefold.config import Config, MemoryConfig, micro_batches_per_step
from moefold.models.mla import MLAttention
from moefold.moe.experts import Experts
from moefold.moe.router import ROUTER_DTYPES, Router
from moefold.optim.adamw import build_optimizer
from moefold.train.flops import attention_flops_per_token, count_params, in_units, meta_model, train_flops_per_token


@dataclasses.dataclass
class Row:
    name: str
    count: int  # instances per step
    seconds_each: float
    flops_each: float  # 0 where FLOPs mean nothing (the optimizer)
    in_sum: bool = True
    optimizer: bool = False

    @property
    def ms(self) -> float:
        return 1e3 * self.seconds_each * self.count

    @property
    def tflops(self) -> float | None:
        return self.flops_each / self.seconds_each / 1e12 if self.flops_each else None


def step_limit(cfg: Config, device: torch.device, compute_dtype: torch.dtype, repeats: int = 10,
               optimizer: bool = True, loss: bool = True, warmup: int = 3,
               micro_batches: int | None = None) -> dict[str, Any]:
    """Time the large kernels of one training step of `cfg` (see the module docstring).
    `micro_batches`: per optimizer step (the trainer's grad_accum); None: the config's on one rank."""
    cfg = dataclasses.replace(copy.deepcopy(cfg), memory=MemoryConfig())
    if micro_batches is None:
        micro_batches = micro_batches_per_step(cfg.train, 1)
    model = meta_model(cfg)  # shapes only
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    shapes = _Shapes(cfg, model, device, compute_dtype, B, S, repeats, warmup)
    rows = [shapes.head(), shapes.attention(), *shapes.projections(), *shapes.experts(),
            *shapes.router()]
    if loss:
        rows.append(shapes.head_with_loss())
    for row in rows:  # every kernel above runs once per micro-batch, the optimizer once a step
        if row is not None:
            row.count *= micro_batches
    if optimizer:
        rows.append(_optimizer_row(cfg, model.vocab_size, device, compute_dtype, repeats))
    rows = [r for r in rows if r is not None and r.count]
    tokens = micro_batches * B * S
    step_flops = train_flops_per_token(model, S) * tokens
    total_s = sum(r.seconds_each * r.count for r in rows if r.in_sum)
    no_opt_s = sum(r.seconds_each * r.count for r in rows if r.in_sum and not r.optimizer)
    return {
        "rows": [{"name": r.name, "count": r.count, "ms": r.ms, "ms_each": 1e3 * r.seconds_each,
                  "flops_each": r.flops_each, "tflops": r.tflops, "in_sum": r.in_sum,
                  "optimizer": r.optimizer} for r in rows],
        "total_ms": 1e3 * total_s, "no_optimizer_ms": 1e3 * no_opt_s, "tokens": tokens,
        "step_flops": step_flops, "max_tflops": step_flops / total_s / 1e12,
        "max_tflops_no_optimizer": step_flops / no_opt_s / 1e12,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


class _Shapes:
    """Builds random inputs in the model's shapes and layouts and times each kernel group."""

    def __init__(self, cfg: Config, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 B: int, S: int, repeats: int, warmup: int):
        self.cfg, self.model, self.device, self.dtype = cfg, model, device, dtype
        self.B, self.S, self.T, self.repeats, self.warmup = B, S, B * S, repeats, warmup
        self.gen = torch.Generator(device).manual_seed(0)
        self.heads = 1 + cfg.model.mtp_layers  # each MTP module uses the shared head once more

    def randn(self, *shape: int, dtype: torch.dtype | None = None, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=dtype or self.dtype, generator=self.gen)
        return t.requires_grad_(grad)

    def time(self, fn) -> float:
        seconds = median_seconds(fn, self.device, warmup=self.warmup, repeats=self.repeats)
        synchronize(self.device)
        return seconds

    def linear(self, name: str, count: int, rows: int, d_in: int, d_out: int,
               dtype: torch.dtype | None = None) -> Row:
        """nn.Linear forward + backward: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x."""
        x, w = self.randn(rows, d_in, dtype=dtype, grad=True), self.randn(d_out, d_in, dtype=dtype, grad=True)
        dy = self.randn(rows, d_out, dtype=dtype)
        seconds = self.time(lambda: torch.autograd.grad(F.linear(x, w), (x, w), dy))
        return Row(name, count, seconds, 6.0 * rows * d_in * d_out)

    def head(self) -> Row:
        out = self.model.output
        return self.linear("output head GEMMs", self.heads, self.T, out.in_features, out.out_features)

    def head_with_loss(self) -> Row:
        """What the head costs with the training loss (fp32-logit cross-entropy): not in the sum."""
        from moefold.train.loss import cross_entropy_loss

        out = self.model.output
        h = self.randn(self.B, self.S, out.in_features, grad=True)
        w = self.randn(out.out_features, out.in_features, grad=True)
        labels = torch.randint(0, out.out_features, (self.B, self.S), device=self.device, generator=self.gen)

        def step():
            loss = cross_entropy_loss(F.linear(h, w), labels)
            torch.autograd.grad(loss, (h, w))

        return Row("  (info) output head + fp32 cross-entropy", self.heads, self.time(step),
                   6.0 * self.T * out.in_features * out.out_features, in_sum=False)

    def attention(self) -> Row:
        blocks = self.model.blocks()
        attn = blocks[0].attn
        B, S = self.B, self.S
        if isinstance(attn, MLAttention):
            H, Dk, Dv, Dn = attn.n_heads, attn.qk_head_dim, attn.v_head_dim, attn.qk_nope_head_dim
            q = self.randn(B, H, S, Dk, grad=True)  # torch.cat output: contiguous
            k = self.randn(B, H, S, Dk, grad=True)
            kv = self.randn(B, S, H, Dn + Dv).transpose(1, 2)  # wkv_b output viewed per head
            v = kv[..., Dn:].detach().requires_grad_(True)
            mask, qk_dim, v_dim = {}, Dk, Dv
        else:
            H, G, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
            q = self.randn(B, S, H, Dh).transpose(1, 2).requires_grad_(True)  # [B, H, S, Dh] view
            k = self.randn(B, S, G, Dh).transpose(1, 2).requires_grad_(True)
            v = self.randn(B, S, G, Dh).transpose(1, 2).requires_grad_(True)
            mask, qk_dim, v_dim, Dv = attn.mask(0, S, self.device), Dh, Dh, Dh
        dout = self.randn(B, S, H, Dv).transpose(1, 2)  # the gradient of out.transpose(1, 2).reshape

        def step():
            torch.autograd.grad(attn.core(q, k, v, **mask), (q, k, v), dout)

        flops = attention_flops_per_token(1, S, H, qk_dim, v_dim, self.cfg.model.sliding_window) * self.T
        return Row("core attention (SDPA)", len(blocks), self.time(step), flops)

    def projections(self) -> list[Row]:
        """Every nn.Linear of the blocks and MTP modules (the head apart), grouped by shape."""
        groups: dict[tuple[bool, int, int], int] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Linear) and module is not self.model.output:
                key = (".attn." in f".{name}.", module.in_features, module.out_features)
                groups[key] = groups.get(key, 0) + 1
        rows: dict[bool, list[Row]] = {True: [], False: []}
        for (is_attn, d_in, d_out), count in groups.items():
            rows[is_attn].append(self.linear("", count, self.T, d_in, d_out))
        return [_merge("attention projections", rows[True], per=len(self.model.blocks())),
                _merge("dense MLP / shared expert / MTP projections", rows[False])]

    def experts(self) -> list[Row]:
        layers = [m for m in self.model.modules() if isinstance(m, Experts)]
        if not layers:
            return []
        e = layers[0]
        E, D, Fh = e.w1_EDF.shape
        rows_E = balanced_rows(self.T * self.cfg.moe.top_k, E, self.cfg.moe.pad_multiple)
        offsets_E = torch.cumsum(rows_E, 0, dtype=torch.int32).to(self.device)
        N = int(rows_E.sum())
        x, h = self.randn(N, D, grad=True), self.randn(N, Fh, grad=True)
        ins = [self.randn(E, D, Fh, grad=True) for _ in range(e.activation.num_inputs)]
        w2 = self.randn(E, Fh, D, grad=True)
        d_hidden, d_out = self.randn(N, Fh), self.randn(N, D)

        def step():
            for w in ins:  # gate (and up): dx per projection, no accumulation kernel
                torch.autograd.grad(torch._grouped_mm(x, w, offs=offsets_E), (x, w), d_hidden)
            torch.autograd.grad(torch._grouped_mm(h, w2, offs=offsets_E), (h, w2), d_out)

        flops = 6.0 * self.T * self.cfg.moe.top_k * D * Fh * (len(ins) + 1)
        return [Row("routed experts (grouped GEMMs)", len(layers), self.time(step), flops)]

    def router(self) -> list[Row]:
        routers = [m for m in self.model.modules() if isinstance(m, Router)]
        if not routers:
            return []
        E, D = routers[0].weight.shape
        dtype = ROUTER_DTYPES[self.cfg.moe.router_dtype]  # the router runs with autocast off
        return [self.linear(f"router GEMM ({self.cfg.moe.router_dtype})", len(routers), self.T, D, E, dtype)]


def _merge(name: str, rows: list[Row], per: int = 0) -> Row | None:
    """One row for several linear shapes; `count` is `per` (the layers) or the number of linears."""
    if not rows:
        return None
    count = per or sum(r.count for r in rows)
    seconds = sum(r.seconds_each * r.count for r in rows) / count
    flops = sum(r.flops_each * r.count for r in rows) / count
    return Row(name, count, seconds, flops)


def balanced_rows(routed: int, num_experts: int, pad_multiple: int = 0) -> torch.Tensor:
    """Rows per expert when `routed` token copies spread evenly (the first experts take the
    remainder), each padded up to a multiple of `pad_multiple` as the permutation pads."""
    rows_E = torch.full((num_experts,), routed // num_experts, dtype=torch.int64)
    rows_E[: routed % num_experts] += 1
    if pad_multiple:
        rows_E = (rows_E + pad_multiple - 1) // pad_multiple * pad_multiple
    return rows_E


def _optimizer_row(cfg: Config, vocab_size: int, device: torch.device, dtype: torch.dtype,
                   repeats: int) -> Row:
    """One step of the optimizer training builds, over the real parameters and random gradients."""
    from moefold.models.transformer import build_model

    gen = torch.Generator(device).manual_seed(1)
    with torch.device(device):
        model = build_model(cfg, vocab_size, device.type, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    optimizer = build_optimizer(model, cfg.train, device, cfg.optim)
    for p in model.parameters():  # after the optimizer: bf16 master weights change their dtype
        p.grad = torch.randn(p.shape, device=device, generator=gen).to(p.dtype)
    seconds = median_seconds(optimizer.step, device, warmup=2, repeats=repeats)
    # It steps every parameter; they print as every count does: the MTP modules apart (flops.py).
    c = count_params(model)
    mtp = f", MTP modules {in_units(c.mtp)} more" if c.mtp else ""
    name = f"optimizer step ({type(optimizer).__name__}, {in_units(c.main_total)} parameters{mtp})"
    del optimizer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Row(name, 1, seconds, 0.0, optimizer=True)


def format_limit(r: dict[str, Any]) -> str:
    head = f"{'kernel group':48s} {'count':>5s} {'ms':>9s} {'TFLOP/s':>8s}"
    lines = [f"step limit on {r['device']} ({r['compute_dtype']}; fp32 matmul precision "
             f"{r['float32_matmul_precision']}), {r['tokens']:,} tokens", head]
    for row in r["rows"]:
        tf = f"{row['tflops']:8.1f}" if row["tflops"] is not None else f"{'-':>8s}"
        lines.append(f"{row['name']:48s} {row['count']:5d} {row['ms']:9.3f} {tf}")
    lines.append(f"{'limit (sum)':48s} {'':5s} {r['total_ms']:9.3f} {r['max_tflops']:8.1f}")
    lines.append(f"{'limit without the optimizer':48s} {'':5s} {r['no_optimizer_ms']:9.3f} "
                 f"{r['max_tflops_no_optimizer']:8.1f}")
    lines.append(f"(TFLOP/s of the limit rows: the step's FLOPs by the convention, "
                 f"{r['step_flops'] / 1e12:.3f} TFLOP, over that time: the most a step can reach)")
    return "\n".join(lines)
