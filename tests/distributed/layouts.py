"""Helpers of the layout tests: a tiny training run in one process (the reference) or on gloo ranks
under a parallel layout, recording each step's loss (averaged over the data ranks, as logged) and
the first step's full gradients; or a whole run (`fit_on_rank`), whose logged records are compared
value by value (`logged_records`, `assert_records_close`).

Both runs see the same global batch and data order: micro_batch_size is the global micro-batch
divided by dp, and the trainer hands each data rank its rows of the same global micro-batch.
"""

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from moefold.config import load_config
from moefold.train.trainer import Trainer

GLOBAL_MICRO_BATCH = 4
STEPS = 10
ALIGNED_QWEN3 = {"model.dim": "128", "model.head_dim": "32", "model.n_kv_heads": "4",
                 "moe.expert_hidden": "128"}  # tiny-qwen3 overrides with dims the FP8 GEMMs take

MODELS = {
    # Qwen3-MoE: GQA with QK-norm, softmax top-k with the micro-batch aux loss and z-loss.
    "qwen3": ("tiny-qwen3", {"moe.aux_loss_coeff": "0.01", "moe.z_loss_coeff": "0.001"}),
    # DeepSeek-V3: MLA, dense first layer, shared expert, grouped sigmoid routing with expert bias
    # and the sequence aux loss, one MTP module.
    "deepseek": ("tiny-deepseek", {"moe.expert_bias_update_rate": "0.01"}),
}


def config(model: str, data_path: Path, dp: int = 1, steps: int = STEPS,
           extra: dict[str, str] | None = None, **parallel: str):
    """The run's config; `extra` overrides anything (e.g. train.device on the GPU machines)."""
    preset, overrides = MODELS[model]
    return load_config(preset, {
        **overrides, "data.path": str(data_path), "train.seq_len": "16",
        "train.micro_batch_size": str(GLOBAL_MICRO_BATCH // dp), "train.steps": str(steps),
        "train.warmup_steps": "2", "train.val_every": "0", "data.val_fraction": "0",
        "train.device": "cpu", "logging.tensorboard": "false", "logging.progress_bar": "false",
        "logging.expert_load_heatmap": "false", "logging.log_every": str(steps),
        "checkpoint.save_at_end": "false",
        **{f"parallel.{k}": str(v) for k, v in parallel.items()}, **(extra or {})})


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective when they are DTensors: call on all ranks)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return grads


def train(cfg, run_dir: Path, resume: Path | None = None, save_at: int = 0, finish=None) -> dict:
    """Losses and gradient norms of every step (mean over the data ranks) and the first step's
    gradients; `finish(trainer)` may add entries read after the last step."""
    trainer = Trainer(cfg, run_dir, resume=resume, out=lambda line: None)
    losses, norms, grads = [], [], None
    while trainer.step < cfg.train.steps:
        parts = trainer.accumulate_gradients()
        if grads is None:
            grads = full_gradients(trainer.model)
        norms.append(trainer.optimizer_step().item())
        trainer.step += 1
        losses.append(trainer.dist.mean_over_data(parts["lm_loss"].detach()).item())
        if trainer.step == save_at:
            trainer.save()
    return {"losses": losses, "grad_norms": norms, "grads": grads, **(finish(trainer) if finish else {})}


def assert_fp8_training_close(result: dict, ref: dict, what: str, grad_rtol: float = 5e-2,
                              late_rtol: float = 2e-2) -> None:
    """An FP8 run under a parallel layout against the same FP8 run in one process. They are close,
    not equal (each data rank scales its own tokens), and the difference grows as training goes:
    first-step gradients within `grad_rtol`, the first five losses each within 2%, the last five's
    mean within `late_rtol`. A wrong scale, layout, padding or reduction is off by far more (O(1)),
    from the first step."""
    for name, grad in ref["grads"].items():
        err = ((result["grads"][name] - grad).norm() / grad.norm()).item()
        assert err < grad_rtol, f"{what}: first-step gradient of {name}: relative error {err:.3g}"
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(ref["losses"])
    torch.testing.assert_close(losses[:5], ref_losses[:5], rtol=2e-2, atol=0,
                               msg=lambda m: f"{what}, first five losses: {m}")
    late, ref_late = losses[-5:].mean().item(), ref_losses[-5:].mean().item()
    assert abs(late / ref_late - 1) < late_rtol, f"{what}: last five losses' mean {late:.4f} against {ref_late:.4f}"


def train_on_rank(rank: int, runs: list[tuple], out: Path) -> None:
    """Each run: (name, model, data_path, dp, parallel sizes, run_dir, resume, save_at[, extra
    overrides]); rank 0 saves {name: result} to `out`."""
    results = {}
    for name, model, data_path, dp, parallel, run_dir, resume, save_at, *extra in runs:
        cfg = config(model, data_path, dp, extra=extra[0] if extra else None, **parallel)
        results[name] = train(cfg, run_dir, resume, save_at)
    if rank == 0:
        torch.save(results, out)


# The fields of a metrics.jsonl record that time the run, which no other run repeats.
TIMING = ("tokens_per_s", "tflops", "mfu", "peak_mem_gib")


def fit_on_rank(rank: int, cfg, run_dir: Path) -> None:
    Trainer(cfg, run_dir, out=lambda line: None).fit()


def logged_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records without the TIMING fields."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def assert_records_close(got_records: list[dict], want_records: list[dict], what: str = "") -> None:
    """Every value of every wanted record is the got record's within 1e-4 relative (NaN equals
    NaN); a failure names `what`, the step and the key."""
    where = f"{what} step" if what else "step"
    for got, want in zip(got_records, want_records):
        for key, value in want.items():
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                       torch.tensor(value, dtype=torch.float64), rtol=1e-4, atol=0,
                                       equal_nan=True,
                                       msg=lambda m, key=key, step=want["step"]: f"{where} {step} {key}: {m}")
