"""`moefold bench`: timed training steps of any config on random tokens.

The model, optimizer and step are the Trainer's own (`Trainer.accumulate_gradients` +
`Trainer.optimizer_step`); only the data differs: uniform random token ids over the model's
vocabulary (`model.vocab_size`, or data.tokenizer's when it is 0), so no corpus is read. Warm-up
steps run first; the timed steps then run back to back with one synchronisation before and one
after (step boundaries are CUDA events, which need no sync). Throughput follows the
FLOP convention of `moefold.train.flops` (docs/metrics.md); MFU is against the dense bf16 matmul
rate measured on the device (bench/timing.py) and against the peak training's MFU divides by
(`logging.peak_tflops` when set, else the datasheet's: the record's `*_datasheet` keys). The table
puts `logging.peak_tflops`'s figure first when it is set, the measured one otherwise.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from moefold.bench.timing import alloc_retries, measured_peak_tflops, time_steps
from moefold.config import Config
from moefold.data.loader import Batch
from moefold.data.tokenizer import model_vocab_size
from moefold.train import metrics
from moefold.train.flops import params_line
from moefold.train.trainer import Trainer


class RandomTokens:
    """The loader interface the Trainer's step reads (`next_batch`): data rank `data_rank`'s rows
    of a global [B, S] batch of uniform random ids, as the training loader reads its rows: the
    ranks train on different tokens, the same ones on any number of data ranks."""

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                 data_rank: int = 0, data_ranks: int = 1):
        self.shape = (batch_size, seq_len + 1)
        self.vocab_size = vocab_size
        self.data_rank, self.data_ranks = data_rank, data_ranks
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> Batch:
        windows_BS1 = torch.randint(0, self.vocab_size, self.shape, generator=self.generator)
        windows_BS1 = windows_BS1.tensor_split(self.data_ranks)[self.data_rank]
        input_ids_BS = windows_BS1[:, :-1].contiguous()
        return Batch(input_ids_BS, windows_BS1[:, 1:].contiguous(),
                     torch.zeros_like(input_ids_BS, dtype=torch.int32))


class BenchTrainer(Trainer):
    """The Trainer with random tokens for data and no run directory written."""

    launch_command = "torchrun --nproc-per-node N -m moefold bench"  # bench has no --nproc

    def _build_data(self) -> None:
        t = self.cfg.train
        self.tokenizer = None
        self.vocab_size = model_vocab_size(self.cfg)
        self.data_source = f"random tokens (vocabulary {self.vocab_size})"
        self.train_loader = RandomTokens(t.micro_batch_size * self.dist.dp_size, t.seq_len,
                                         self.vocab_size, t.seed, self.dist.dp_rank, self.dist.dp_size)
        self.val_batches = []

    def _prepare_run_dir(self) -> None:
        pass

    def _another_step_follows(self) -> bool:
        return True  # bench counts its steps itself (`step` stays 0): each reads the next, as training's do


@dataclasses.dataclass
class BenchResult:
    record: dict[str, Any]
    trainer: BenchTrainer


def run_bench(cfg: Config, steps: int, warmup: int) -> BenchResult:
    """Build as training does, run `warmup` steps, then time `steps` steps back to back."""
    trainer = BenchTrainer(cfg, Path(tempfile.gettempdir()) / "moefold-bench-no-run-dir",
                           out=lambda line: None)
    device = trainer.device
    peak = measured_peak_tflops(device)  # before the steps: its buffers are freed again
    step_s, (parts, grad_norm) = time_steps(trainer.train_step, device, steps, warmup)
    return BenchResult(_record(cfg, trainer, step_s, peak, parts, grad_norm, warmup), trainer)


def _record(cfg: Config, trainer: BenchTrainer, step_s: list[float], peak: float | None,
            parts: dict, grad_norm: torch.Tensor, warmup: int) -> dict[str, Any]:
    t, world = cfg.train, trainer.dist.world
    tokens_per_step = trainer.grad_accum * t.micro_batch_size * trainer.dist.dp_size * t.seq_len
    seconds = sum(step_s)
    tokens = tokens_per_step * len(step_s) / world  # per device, as training divides; it logs the job's
    rate = metrics.throughput(tokens, seconds, trainer.flops_per_token, peak)
    datasheet = trainer.peak_tflops  # logging.peak_tflops when set, as training's MFU
    p = trainer.param_counts
    return {
        "family": cfg.model.family, "device": _device_name(trainer.device),
        "compute_dtype": str(trainer.compute_dtype).removeprefix("torch."), "world": world,
        "torch": torch.__version__, "commit": _commit(), "date": datetime.date.today().isoformat(),
        "steps": len(step_s), "warmup": warmup, "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len, "grad_accum": trainer.grad_accum, "data_ranks": trainer.dist.dp_size,
        "vocab_size": trainer.vocab_size,
        "tokens_per_step": tokens_per_step, "tokens": tokens, "seconds": seconds,
        "step_ms_mean": 1e3 * statistics.fmean(step_s), "step_ms_min": 1e3 * min(step_s),
        "step_ms_max": 1e3 * max(step_s), "step_ms": [1e3 * s for s in step_s],
        "tokens_per_s": rate["tokens_per_s"], "flops_per_token": trainer.flops_per_token,
        "tflops": rate["tflops"], "peak_tflops_measured": peak, "mfu": rate["mfu"],
        "peak_tflops_datasheet": datasheet, "peak_tflops_configured": cfg.logging.peak_tflops or None,
        "mfu_datasheet": rate["tflops"] / datasheet if datasheet else None,
        "peak_mem_gib": metrics.peak_memory_gib(trainer.device),
        "alloc_retries": alloc_retries(trainer.device),
        "params_total": p.main_total, "params_active": p.main_active,  # as `config params` counts them
        "params_mtp": p.mtp, "params_mtp_active": p.mtp_active,
        # the last step's, over the data ranks as training logs it (each rank's rows differ)
        "loss": float(trainer.dist.mean_over_data(parts["lm_loss"].detach().float())), "grad_norm": float(grad_norm),
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _mfu(r: dict[str, Any]) -> str:
    """MFU against each peak the record has, `logging.peak_tflops` first when it is set (the one
    training reports), else the measured one first."""
    reference = "logging.peak_tflops" if r["peak_tflops_configured"] else "the datasheet"
    figures = [(r["mfu"], "the measured", r["peak_tflops_measured"]),
               (r["mfu_datasheet"], reference, r["peak_tflops_datasheet"])]
    if r["peak_tflops_configured"]:
        figures.reverse()
    said = [f"{100 * mfu:.1f}% of {name} {_tflops(peak)}" for mfu, name, peak in figures if mfu is not None]
    if not said:
        return "- (no measured peak on the CPU; logging.peak_tflops sets one)"
    return f"{said[0]} TFLOP/s" + "".join(f" ({other})" for other in said[1:])


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _tflops(peak: float) -> str:
    return f"{peak:.0f}" if peak >= 10 else f"{peak:g}"


def format_record(r: dict[str, Any]) -> str:
    """The result as a two-column table (what `moefold bench` prints)."""
    rows = [
        ("device", f"{r['device']} ({r['compute_dtype']}), torch {r['torch']}"
                   + (f", {r['world']} ranks" if r["world"] > 1 else "")),
        ("batch", f"{r['micro_batch_size']} × {r['seq_len']} tokens × "
                  f"{_count(r['grad_accum'], 'micro-batch', 'micro-batches')}"
                  + (f" × {r['data_ranks']} data ranks" if r["data_ranks"] > 1 else "")
                  + f" = {r['tokens_per_step']:,} tokens per step (vocabulary {r['vocab_size']:,})"),
        ("model", f"{params_line(r['params_total'], r['params_active'], r['params_mtp'], r['params_mtp_active'])}; "
                  f"{r['flops_per_token'] / 1e6:,.2f} MFLOP per token (fwd+bwd)"),
        ("step time", f"{r['step_ms_mean']:.2f} ms mean, {r['step_ms_min']:.2f} ms min, "
                      f"{r['step_ms_max']:.2f} ms max ({_count(r['steps'], 'step', 'steps')} after "
                      f"{r['warmup']} warm-up)"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}" + (f" per device, {r['tokens_per_s'] * r['world']:,.0f} for the "
                                                     f"job of {r['world']} ranks" if r["world"] > 1 else "")),
        ("TFLOP/s", f"{r['tflops']:.3f}"),
        ("MFU", _mfu(r)),
        ("peak memory", f"{r['peak_mem_gib']:.2f} GiB"
                        + (" (process max RSS)" if r["device"] == "cpu" else
                           f" (allocated; {r['alloc_retries']} allocator retries)")),
        ("loss", f"{r['loss']:.4f} (random tokens: ln V = {torch.log(torch.tensor(float(r['vocab_size']))):.4f})"),
    ]
    limit = r.get("limit")
    if limit:
        rows.append(("limit", f"{limit['total_ms']:.2f} ms (large kernels alone; "
                              f"{limit['no_optimizer_ms']:.2f} ms without the optimizer)"))
        rows.append(("of the limit", f"{r['limit_fraction']:.3f} (limit / step time; "
                                     f"{r['limit_fraction_no_optimizer']:.3f} without the optimizer)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
