"""Routed experts: E MLPs stored as stacked `[E, ...]` weights, ready for EP/ETP sharding.

R rows grouped by expert, D model dim, F expert hidden, E experts.
Backends differ only in `_mm`, the grouped matrix product (FP8 also in `_input_mms`, the gate and
up projections together, so that their shared input is quantized once); the activation (and
whether it applies the routing probabilities) is a strategy given at build time. Rows past the
last group are never read: grouped_mm skips them and the loop slices them off.
"""

import contextlib
import functools

import torch
from torch import nn

from moefold.errors import ConfigError
from moefold.fp8.grouped import fp8_grouped_mm, fp8_grouped_mms
from moefold.fp8.saved import SaveInput
from moefold.fp8.weight_cache import PerCallWeights
from moefold.moe.activation import ACTIVATIONS, PlainActivation, ProbsInActivation
from moefold.moe.grouped_mm import grouped_mm
from moefold.parallel.local import local_tensor


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (grouped_mm is not an autocast op), else x's dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class Experts(nn.Module):
    """Base class: down(act(x·W1[, x·W3]) [· probs]) per expert group."""

    def __init__(self, num_experts: int, dim: int, hidden: int,
                 activation: PlainActivation | ProbsInActivation | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation or PlainActivation(ACTIVATIONS["swiglu"])
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))  # gate (or the only input)
        if self.activation.num_inputs == 2:
            self.w3_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))  # up
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))  # down

    def input_weight_names(self) -> list[str]:
        """The input projections' weights (gate and up, or the only one), which read the same x."""
        return ["w1_EDF", "w3_EDF"] if self.activation.num_inputs == 2 else ["w1_EDF"]

    def input_weights(self) -> list[torch.Tensor]:
        return [local_tensor(getattr(self, name)) for name in self.input_weight_names()]

    def forward(self, x_RD: torch.Tensor, rows_per_expert_E: torch.Tensor,
                probs_R: torch.Tensor | None = None) -> torch.Tensor:
        dtype = compute_dtype(x_RD)
        x_RD = x_RD.to(dtype)
        offsets_E = torch.cumsum(rows_per_expert_E, dim=0, dtype=torch.int32)
        hidden_RF = self._input_mms(x_RD, [w.to(dtype) for w in self.input_weights()], offsets_E)
        return self._down(probs_R, hidden_RF, local_tensor(self.w2_EFD).to(dtype), offsets_E)

    def _down(self, probs_R: torch.Tensor | None, hidden_RF: list[torch.Tensor], w2_EFD: torch.Tensor,
              offsets_E: torch.Tensor) -> torch.Tensor:
        """The activation and the down projection, in w2's dtype: one seam, which memory.recompute's
        moe_act under train.compile checkpoints as a whole (memory/sites.py)."""
        h_RF = self.activation(probs_R, *hidden_RF).to(w2_EFD.dtype)
        return self._mm(h_RF, w2_EFD, offsets_E)

    def _input_mms(self, x_RD: torch.Tensor, ws_EDF: list[torch.Tensor],
                   offsets_E: torch.Tensor) -> list[torch.Tensor]:
        """The input projections (gate and up, or the only one), which read the same x."""
        return [self._mm(x_RD, w_EDF, offsets_E) for w_EDF in ws_EDF]

    def _mm(self, x_RX: torch.Tensor, w_EXY: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupedMMExperts(Experts):
    """One `torch._grouped_mm` per projection: no host sync, one launch for all experts (kept out of
    torch.compile's graph outside bf16, moe/grouped_mm.py)."""

    def _mm(self, x_RX, w_EXY, offsets_E):
        return grouped_mm(x_RX, w_EXY, offsets_E)


class LoopExperts(Experts):
    """One matmul per expert. Needs the group sizes on the host (a sync); a fallback only."""

    def _mm(self, x_RX, w_EXY, offsets_E):
        ends = offsets_E.tolist()  # HOST SYNC: per-expert slices need sizes on the host
        starts = [0] + ends[:-1]
        outs = [x_RX[s:e] @ w_EXY[i] for i, (s, e) in enumerate(zip(starts, ends))]
        unused_rows = x_RX.new_zeros(x_RX.shape[0] - ends[-1], w_EXY.shape[-1])
        return torch.cat([*outs, unused_rows], dim=0)


class Fp8GroupedExperts(Experts):
    """The grouped GEMMs in FP8 (fp8/grouped.py): emulated on CPU, torch._scaled_grouped_mm on CUDA.

    Built by `moefold.fp8.apply.apply_fp8` from a built layer's experts (same parameters); group
    sizes must be multiples of `scaling.row_multiple`, which apply_fp8 makes the layer's padding.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int,
                 activation: PlainActivation | ProbsInActivation | None, gemm, scaling,
                 saver=None, device=None, weight_cache=None):
        with torch.device(device) if device is not None else contextlib.nullcontext():
            super().__init__(num_experts, dim, hidden, activation)
        self.gemm, self.scaling, self.saver = gemm, scaling, saver  # saver: fp8/saved.py
        self.down_saver = saver  # what the down GEMM keeps of the activation's output
        self.weight_cache = weight_cache or PerCallWeights()  # fp8/weight_cache.py

    def memory_site_wrapped(self, name: str) -> None:
        """Told by memory/sites.py at each wrap of one of this module's callables, whether the
        wrap came before apply_fp8 put this module in place (carried over by `rewrap`) or after it
        (apply_recompute from Python). `_mm` is wrapped only as the consumer of moe_act's output
        discarding (eager memory.recompute): the activation's output h is freed once the down GEMM
        ran and rebuilt for its backward, so the GEMM keeps h as it is; an FP8 copy
        (precision.fp8_saved_activations) would outlive the free. Compiled blocks wrap `_down`
        instead, which recomputes h only to quantize it again: the FP8 copy stays."""
        if name == "_mm":
            self.down_saver = SaveInput()

    def weight_names(self) -> list[str]:
        return [*self.input_weight_names(), "w2_EFD"]

    def _input_mms(self, x_RD, ws_EDF, offsets_E):
        """Gate and up in one autograd Function: x quantized (and kept) once for both."""
        cached = self.weight_cache.operands(self, self.input_weight_names())
        return fp8_grouped_mms(x_RD, ws_EDF, offsets_E, self.gemm, self.scaling, self.saver, cached)

    def _mm(self, x_RX, w_EXY, offsets_E):
        """The down projection (`_input_mms` takes the others)."""
        cached = self.weight_cache.operands(self, ["w2_EFD"])
        return fp8_grouped_mm(x_RX, w_EXY, offsets_E, self.gemm, self.scaling, self.down_saver, cached)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs `torch._grouped_mm` forward and backward on device/dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # constant operands: a probe must not draw from the seeded generator the weights use
        x = torch.full((32, 16), 0.5, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.full((2, 16, 16), 0.25, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([16, 32], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(32, 16, device=device_type, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm_aligned(dim: int, hidden: int, dtype: torch.dtype) -> bool:
    """`torch._grouped_mm` needs every operand's rows to start 16 bytes apart."""
    return all(size * dtype.itemsize % 16 == 0 for size in (dim, hidden))


EXPERTS_BACKENDS = {"grouped_mm": GroupedMMExperts, "loop": LoopExperts}


def expert_hidden_slice(hidden: int, etp: int) -> str:
    """The experts' hidden size one ETP rank's GEMMs see, as errors name it."""
    if etp == 1:
        return f"moe.expert_hidden ({hidden})"
    return f"moe.expert_hidden / parallel.etp ({hidden} / {etp} = {hidden / etp:g})"


def build_experts(backend: str, num_experts: int, dim: int, hidden: int, device_type: str,
                  compute_dtype: torch.dtype, activation: str = "swiglu",
                  probs_in_activation: bool = False, etp: int = 1) -> Experts:
    """`etp`: the expert-tensor-parallel ranks that split `hidden` (parallel.etp); the GEMMs run on
    one slice, so the alignment that picks the backend is the slice's."""
    aligned = grouped_mm_aligned(dim, hidden // etp, compute_dtype)
    if backend == "auto":
        backend = "grouped_mm" if grouped_mm_supported(device_type, compute_dtype) and aligned else "loop"
    elif backend == "grouped_mm" and not aligned:
        multiple, dtype_name = 16 // compute_dtype.itemsize, str(compute_dtype).removeprefix("torch.")
        raise ConfigError(f"moe.experts_backend=grouped_mm needs model.dim ({dim}) and "
                          f"{expert_hidden_slice(hidden, etp)} to be "
                          f"multiples of {multiple} in {dtype_name} (rows of 16 bytes); use "
                          "moe.experts_backend=auto or loop")
    act = (ProbsInActivation if probs_in_activation else PlainActivation)(ACTIVATIONS[activation])
    return EXPERTS_BACKENDS[backend](num_experts, dim, hidden, act)
