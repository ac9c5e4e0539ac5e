"""What a training run reports against references computed here from docs/metrics.md's words: a
log window's values from the same run logged every step, the pre-clip gradient norm from the
gradients themselves, the CPU's peak memory from the kernel's own count, TensorBoard's scalars
from metrics.jsonl, the console line and `moefold bench`'s table from their records."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_OVERRIDES
from memory_runs import one_thread  # noqa: F401 (autouse: ops this small run faster on one thread)

from moefold.cli import main
from moefold.config import load_config
from moefold.train import metrics
from moefold.train.trainer import Trainer

# grad_accum 2, MTP, capacity drops, every aux loss, clipping that bites
FEATURES = {"train.grad_accum": "2", "model.mtp_layers": "1", "moe.capacity_factor": "1.0",
            "moe.aux_loss_coeff": "0.01", "moe.seq_aux_loss_coeff": "0.01", "moe.global_aux_loss_coeff": "0.01",
            "moe.z_loss_coeff": "0.001", "train.grad_clip": "0.5", "train.steps": "6"}


def tiny_config(corpus: Path, **overrides):
    return load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), **FEATURES,
                              **{key: str(value) for key, value in overrides.items()}})


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load_summary(counts_LE: list[list[int]]) -> dict[str, float]:
    """docs/metrics.md's load figures of one window's tokens per expert per layer, written out."""
    imbalance, cv, dead = [], [], []
    for counts in counts_LE:
        mean = sum(counts) / len(counts)
        imbalance.append(max(counts) / mean)
        cv.append(math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean)
        dead.append(counts.count(0) / len(counts))
    return {"load_imbalance": sum(imbalance) / len(imbalance), "load_imbalance_max": max(imbalance),
            "load_cv": sum(cv) / len(cv), "dead_expert_fraction": sum(dead) / len(dead),
            "load_imbalance_per_layer": imbalance}


def test_a_window_of_steps_logs_the_mean_of_its_steps_and_the_load_of_their_summed_counts(tmp_path, text_corpus):
    """log_every 3 against the same run logged every step: loss, mtp_loss, grad_norm, each aux loss
    (and per layer), routing entropy and dropped fraction are the mean of the window's steps (each
    step routes as many tokens), lr the last step's, and the load figures those of the window's
    tokens per expert (the sum of its steps'), not a mean of the steps' ratios."""
    runs = {}
    for every in (1, 3):
        trainer = Trainer(tiny_config(text_corpus, **{"logging.log_every": every}), tmp_path / str(every),
                          out=lambda line: None)
        trainer.fit()
        runs[every] = ([r for r in read_records(tmp_path / str(every)) if "loss" in r], trainer.load_history)
    steps, history = runs[1]
    windows, window_history = runs[3]
    assert [r["step"] for r in windows] == [3, 6] and any(r["dropped_fraction"] > 0 for r in steps)
    for w, (window_step, counts_LE) in zip(windows, window_history, strict=True):
        inside = steps[window_step - 3:window_step]
        summed_LE = [[sum(c) for c in zip(*layer)] for layer in zip(*(h[1] for h in history[window_step - 3:window_step]))]
        assert counts_LE == summed_LE
        assert w["lr"] == inside[-1]["lr"]
        for key in ("loss", "mtp_loss", "grad_norm", "aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss",
                    "routing_entropy", "dropped_fraction"):
            assert w[key] == pytest.approx(sum(r[key] for r in inside) / 3, rel=1e-5), key
        for key in ("aux_loss_per_layer", "z_loss_per_layer"):
            mean_L = [sum(layer) / 3 for layer in zip(*(r[key] for r in inside))]
            assert w[key] == pytest.approx(mean_L, rel=1e-5), key
        for key, value in load_summary(summed_LE).items():
            assert w[key] == pytest.approx(value, rel=1e-12), key


def test_grad_norm_is_the_norm_before_clipping(tmp_path, text_corpus):
    """grad_norm is the L2 norm of every gradient of the step before clipping (as Megatron-Core and
    TorchTitan log it), whether or not train.grad_clip scales them down."""
    norms = {}
    for clip in ("0", "1e-4"):
        trainer = Trainer(tiny_config(text_corpus, **{"train.grad_clip": clip}), tmp_path / clip,
                          out=lambda line: None)
        trainer.accumulate_gradients()
        grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
        naive = math.sqrt(sum(float((g * g).sum()) for g in grads))
        norms[clip] = float(trainer.optimizer_step())
        assert norms[clip] == pytest.approx(naive, rel=1e-5)
    assert norms["0"] == pytest.approx(norms["1e-4"], rel=1e-6) and norms["0"] > 1e-3


def test_peak_memory_on_the_cpu_is_the_processes_peak_resident_memory():
    """On the CPU peak_mem_gib is the process's peak resident set (the kernel's VmHWM), in GiB
    (getrusage's count may lag /proc's by the kernel's per-thread RSS cache: 1%)."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs Linux's /proc")
    before = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
    gib = metrics.peak_memory_gib(torch.device("cpu"))
    after = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
    assert before / 2**20 * 0.99 <= gib <= after / 2**20 * 1.01


class FakeWriter:
    """What the trainer's TensorBoard writer is given: (tag, value, step) of every add_scalar."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        pass


def test_tensorboard_gets_every_value_of_metrics_jsonl(tmp_path, text_corpus, monkeypatch):
    """docs/metrics.md: TensorBoard's events are a copy of metrics.jsonl. Every finite number of
    every record (validation's too) is a scalar at the record's step, each per-layer list element
    one under `<key>/<layer index>`; nothing else is."""
    writer = FakeWriter()
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda path, first_step: writer)
    cfg = tiny_config(text_corpus, **{"logging.tensorboard": "true", "logging.log_every": "2", "train.steps": "4",
                                      "train.val_every": "2", "train.grad_accum": "1"})
    Trainer(cfg, tmp_path / "run", out=lambda line: None).fit()
    expected = []
    for r in read_records(tmp_path / "run"):
        for key, value in r.items():
            if key == "step":
                continue
            elements = [(f"{key}/{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            expected += [(tag, v, r["step"]) for tag, v in elements if v is not None]
    assert any(tag.endswith("_per_layer/1") for tag, _, _ in expected) and any(t == "val_loss" for t, _, _ in expected)
    assert sorted(writer.scalars) == sorted(expected)


def test_the_console_line_shows_the_records_values(tmp_path, text_corpus):
    """Each figure the console prints is the record's: loss, grad_norm, lr, the job's tokens/s,
    TFLOP/s, MFU (over logging.peak_tflops), memory, aux, imbalance, dropped, val_loss."""
    lines = []
    cfg = tiny_config(text_corpus, **{"train.steps": "2", "train.val_every": "2", "logging.peak_tflops": "1e-3"})
    Trainer(cfg, tmp_path / "run", out=lines.append).fit()
    train_record, val_record = read_records(tmp_path / "run")[-2:]
    r = train_record
    want = (f"step 2/2 | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | {r['tflops']:.3f} TFLOP/s | mfu {100 * r['mfu']:.1f}% | "
            f"mem {r['peak_mem_gib']:.2f} GiB | aux {r['aux_loss']:.4f} | imbalance {r['load_imbalance']:.2f} | "
            f"dropped {100 * r['dropped_fraction']:.1f}%")
    assert want in lines and f"step 2/2 | val_loss {val_record['val_loss']:.4f}" in lines


def test_bench_json_is_its_printed_table(tmp_path, capsys):
    """Every figure `moefold bench` prints is its --json record's, in the record's units."""
    path = tmp_path / "r.json"
    capsys.readouterr()
    assert main(["bench", "--config", "tiny-deepseek", "--steps", "2", "--warmup", "0", "--json", str(path),
                 "--train.micro_batch_size", "2", "--train.seq_len", "32", "--train.grad_accum", "2",
                 "--logging.peak_tflops", "0.001"]) == 0
    rows = {label: line[len(label):].strip() for line in capsys.readouterr().out.splitlines()[1:]
            for label in ("device", "batch", "model", "step time", "tokens/s", "TFLOP/s", "MFU", "peak memory", "loss")
            if line.startswith(label + " ")}
    r = json.loads(path.read_text())
    assert r["tokens_per_step"] == 2 * 32 * 2 and r["tokens"] == 2 * r["tokens_per_step"]
    assert rows["batch"].startswith(f"2 × 32 tokens × 2 micro-batches = {r['tokens_per_step']:,} tokens per step")
    assert rows["step time"].startswith(f"{r['step_ms_mean']:.2f} ms mean, {r['step_ms_min']:.2f} ms min, "
                                        f"{r['step_ms_max']:.2f} ms max (2 steps after 0 warm-up)")
    assert r["step_ms_mean"] == pytest.approx(sum(r["step_ms"]) / 2, rel=1e-12)
    assert r["seconds"] == pytest.approx(sum(r["step_ms"]) / 1e3, rel=1e-12)
    assert rows["tokens/s"] == f"{r['tokens_per_s']:,.0f}"
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-12)
    assert rows["TFLOP/s"] == f"{r['tflops']:.3f}"
    assert rows["MFU"] == f"{100 * r['mfu_datasheet']:.1f}% of logging.peak_tflops 0.001 TFLOP/s"
    assert rows["peak memory"] == f"{r['peak_mem_gib']:.2f} GiB (process max RSS)"
    assert rows["loss"].startswith(f"{r['loss']:.4f} ")
    assert rows["model"].endswith(f"; {r['flops_per_token'] / 1e6:,.2f} MFLOP per token (fwd+bwd)")


def test_dropped_fraction_is_the_copies_over_each_experts_capacity(tmp_path, text_corpus):
    """Each step's dropped_fraction against docs/metrics.md's definition counted here from the
    step's routed copies per expert (one micro-batch a step, so its counts): an expert keeps
    C = ceil(capacity_factor · T·K / E) copies and drops the rest, over all layers' routed copies."""
    cfg = tiny_config(text_corpus, **{"train.grad_accum": "1", "train.steps": "3", "moe.capacity_factor": "1.25"})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    trainer.fit()
    t, moe = cfg.train, cfg.moe
    capacity = math.ceil(1.25 * t.micro_batch_size * t.seq_len * moe.top_k / moe.num_experts)
    records = [r for r in read_records(tmp_path / "run") if "loss" in r]
    assert any(r["dropped_fraction"] > 0 for r in records)
    for r, (_, counts_LE) in zip(records, trainer.load_history, strict=True):
        dropped = sum(max(0, c - capacity) for counts in counts_LE for c in counts)
        assert r["dropped_fraction"] == pytest.approx(dropped / sum(map(sum, counts_LE)), rel=1e-12)
