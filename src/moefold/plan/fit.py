"""A run whose model cannot fit, refused before anything is built.

The floor: every parameter's weight, its gradient (autograd keeps it in the weight's dtype) and
AdamW's two moments (plus PrecisionAwareAdamW's int16 remainder) live on some rank for the whole
run, and the fullest rank holds at least the average share. Nothing else is counted (no activation,
buffer or replica), so a run refused here could never have run; the planner (`moefold plan memory`)
predicts the real peak. Why check at all: the allocator finds out late — on the CPU, Linux grants
the memory and the kernel kills the process once it is touched (minutes into building a model with
a mistyped `model.n_layers`); on a GPU, the moments are allocated at the first optimizer step, after
the compile and the first forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moefold.config import Config
from moefold.errors import ConfigError
from moefold.plan.memory import MASTER_BYTES, MOMENT_BYTES
from moefold.plan.params import model_params

GIB = 1024 ** 3


def state_bytes_per_parameter(cfg: Config) -> float:
    """Weight, gradient, both moments and the master's remainder of one parameter. The parameters
    are the master (fp32 ones train under autocast; bf16 ones whatever the compute dtype)."""
    o = cfg.optim
    remainder = 2 if o.master_dtype == "bf16+remainder" else 0
    return 2 * MASTER_BYTES[o.master_dtype] + MOMENT_BYTES[o.exp_avg_dtype] + MOMENT_BYTES[o.exp_avg_sq_dtype] \
        + remainder


def host_memory_bytes(meminfo: Path = Path("/proc/meminfo"),
                      cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """RAM and swap this process may use: /proc/meminfo's, with a cgroup v2 limit where it is
    lower; None where the system does not say (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        ram, swap = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        return None
    return min(ram, _cgroup_limit(cgroup / "memory.max")) + min(swap, _cgroup_limit(cgroup / "memory.swap.max"))


def _cgroup_limit(path: Path) -> float:
    try:
        text = path.read_text().strip()
    except OSError:
        return float("inf")
    return float("inf") if text == "max" else int(text)


@dataclass(frozen=True)
class Capacity:
    """Memory that `ranks` ranks of a job have together (`what` says whose, for the error)."""
    bytes: int
    ranks: int
    what: str


def rank_capacity(device: torch.device, ranks_on_host: int) -> Capacity | None:
    """A GPU's whole memory for its one rank; on the CPU, the host's for all its ranks; None
    where it is unknown."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Capacity(total, 1, f"the GPU has {total / GIB:.1f} GiB")
    total = host_memory_bytes() if device.type == "cpu" else None
    if total is None:
        return None
    return Capacity(total, ranks_on_host, f"this host has {total / GIB:.1f} GiB of RAM and swap")


def refuse_model_beyond_memory(cfg: Config, vocab_size: int, world_size: int, capacity: Capacity | None) -> None:
    """ConfigError when the fullest rank's share of weights, gradients and optimizer states,
    times the ranks sharing `capacity`, exceeds it; no check when the capacity is unknown."""
    if capacity is None:
        return
    params = model_params(cfg, vocab_size).total
    per_param = state_bytes_per_parameter(cfg)
    need = params * per_param / world_size * capacity.ranks
    if need <= capacity.bytes:
        return
    if world_size == 1:
        on = ""
    elif capacity.ranks == 1:
        on = f" on the fullest of its {world_size} ranks"
    else:
        on = f" on the {capacity.ranks} ranks this host runs"
    raise ConfigError(
        f"the model's {params / 1e9:,.2f}B parameters need at least {need / GIB:,.1f} GiB{on} for their "
        f"weights, gradients and AdamW moments alone ({per_param:g} bytes each), and {capacity.what}: make "
        "the model smaller (model.n_layers, model.dim, moe.num_experts, ...), add ranks, or keep states "
        "in less (optim.master_dtype, optim.exp_avg_dtype, optim.exp_avg_sq_dtype)")
