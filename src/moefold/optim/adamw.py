"""AdamW with decoupled weight decay on matrices only (not norms, biases or embeddings).

All-fp32 states use torch's fused (GPU) or foreach (CPU) AdamW; lower-precision moments or master
weights use `PrecisionAwareAdamW` (optim/precision.py), on the GPU with its Triton kernel
(optim/fused.py: fp32, bf16 and fp8 moments). `optim.grad_dtype=bf16` rounds the gradients
to bf16 before every step (parallel/data.py reduces them in it). docs/optimizer.md has the details.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moefold.config import OptimConfig, TrainConfig
from moefold.optim.fused import fused_supported, triton_available
from moefold.optim.precision import PrecisionAwareAdamW
from moefold.parallel.data import scale_gradients
from moefold.parallel.local import local_tensor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (but not embeddings) with weight decay, the rest without; each split into DTensor
    and plain parameters, which one foreach/fused kernel call cannot mix. (No layout mixes them
    today: one process has plain parameters; FSDP2 and ZeRO-1's shards are all DTensors.) `model`
    is the module whose parameters the optimizer updates: under ddp, ZeRO-1's `ShardModule`."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2 and "tok_embeddings" not in name
        groups.setdefault((decay, isinstance(p, DTensor)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class AdamW(torch.optim.AdamW):
    """torch's AdamW whose kernel stays this process's choice when a state dict loads: torch's
    load_state_dict puts back the saver's `fused` and `foreach` with its hyperparameters, so a GPU
    run resumed from a CPU run's checkpoint stepped with foreach, which refuses the clip coefficient
    handed to the fused kernel (`ClipInFusedAdamW`: an AssertionError at the first step). torch
    leaves a foreach saver's step counts on the CPU, where the fused kernel reads them on the
    parameters' device: they move there, as torch's load does for a fused saver."""

    def load_state_dict(self, state_dict: dict) -> None:
        chosen = [{key: group[key] for key in ("fused", "foreach")} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, keys in zip(self.param_groups, chosen, strict=True):
            group.update(keys)
            for p in group["params"] if keys["fused"] else []:
                state = self.state[p]
                if "step" in state:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def round_gradients(dtype: torch.dtype):
    """An optimizer step pre-hook that rounds every gradient to `dtype` in place (it keeps its
    storage dtype, which autograd ties to the parameter's): the step sees `dtype` gradients
    whether or not they were reduced in it, and after clipping, which may leave them off the grid."""
    @torch.no_grad()
    def hook(optimizer, args, kwargs) -> None:
        grads = [local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and p.grad.dtype != dtype]
        if grads:
            torch._foreach_copy_(grads, [g.to(dtype) for g in grads])
    return hook


def build_optimizer(model: nn.Module, t: TrainConfig, device: torch.device,
                    o: OptimConfig | None = None) -> torch.optim.Optimizer:
    o = o or OptimConfig()
    optimizer = _build(model, t, device, o)
    if o.grad_dtype != "fp32":
        optimizer.register_step_pre_hook(round_gradients(GRAD_DTYPES[o.grad_dtype]))
    return optimizer


def _build(model: nn.Module, t: TrainConfig, device: torch.device, o: OptimConfig):
    if (o.exp_avg_dtype, o.exp_avg_sq_dtype, o.master_dtype) != ("fp32", "fp32", "fp32"):
        # One kernel pass per parameter on the GPU, where the kernel handles the moments.
        fused = (device.type == "cuda" and fused_supported(o.exp_avg_dtype, o.exp_avg_sq_dtype)
                 and triton_available())
        # Converts bf16-master parameters to bf16 in place: build it after the weights are set.
        return PrecisionAwareAdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                   eps=t.eps, weight_decay=t.weight_decay, exp_avg_dtype=o.exp_avg_dtype,
                                   exp_avg_sq_dtype=o.exp_avg_sq_dtype, master=o.master_dtype, fused=fused)
    # fused on GPU (one kernel for all parameters); foreach on CPU, where fused gives no gain.
    fused = device.type == "cuda"
    return AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                 fused=fused, foreach=None if fused else True)


class ClipInFusedAdamW:
    """The clip coefficient handed to torch's fused AdamW as its gradient unscale factor
    (`grad_scale`, which the kernel divides every gradient by as it reads it): no separate pass
    over all gradients to scale them. The gradients are left clipped, as after in-place scaling."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def __call__(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        self.optimizer.grad_scale = coef.reciprocal()


class ClipInFusedPrecisionAdamW:
    """The clip coefficient handed to PrecisionAwareAdamW's Triton kernel as `grad_multiplier`,
    which the kernel MULTIPLIES every gradient by as it reads it (torch's `grad_scale` divides): no
    separate pass over the gradients. The kernel writes them back clipped, as in-place scaling leaves
    them; the step consumes the coefficient, so a later step without clipping is not scaled. bf16
    gradients (bf16 masters) are multiplied in fp32, one rounding fewer than scaling them in place
    (a bf16 product by the bf16-rounded coefficient)."""

    def __init__(self, optimizer: PrecisionAwareAdamW):
        self.optimizer = optimizer

    def __call__(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        self.optimizer.grad_multiplier = coef


def clip_scaling(optimizer: torch.optim.Optimizer, o: OptimConfig):
    """How clipping scales the gradients: inside the step's fused kernel, else in place. torch's
    fused AdamW only when nothing rounds the gradients before it (optim.grad_dtype fp32: with bf16
    a pre-hook rounds the fp32 gradients unclipped). PrecisionAwareAdamW's Triton kernel always: it
    multiplies the (possibly bf16) gradients in fp32, one rounding fewer than in place."""
    fused = optimizer.defaults.get("fused")
    if fused and isinstance(optimizer, torch.optim.AdamW) and o.grad_dtype == "fp32":
        return ClipInFusedAdamW(optimizer)
    if fused and isinstance(optimizer, PrecisionAwareAdamW):
        return ClipInFusedPrecisionAdamW(optimizer)
    return scale_gradients

