import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Under pytest-xdist (the README's `-n 2`) each worker computes on one thread, as do the processes
# it starts (the CLI, torchrun's ranks): two workers on the CI machine's two cores then never
# oversubscribe them, where OpenMP pools that do stall (an 8 s test took 120-280 s).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after OMP_NUM_THREADS: torch sizes its pool from it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# A model and data small enough that a training run takes about a second.
TINY_OVERRIDES = {
    "model.dim": "32", "model.n_layers": "2", "model.n_heads": "2", "model.n_kv_heads": "1",
    "model.ffn_hidden": "64", "moe.num_experts": "4", "moe.top_k": "2", "moe.expert_hidden": "32",
    "moe.first_k_dense": "1", "train.seq_len": "32", "train.micro_batch_size": "4",
    "train.steps": "12", "train.warmup_steps": "2", "train.val_every": "0", "train.val_batches": "2",
    "logging.log_every": "1", "logging.tensorboard": "false", "logging.progress_bar": "false",
    "train.device": "cpu",  # CPU runs are bit-reproducible, which the resume tests rely on
    "logging.expert_load_heatmap": "false",
}


def write_text_corpus(root: Path) -> Path:
    """Fill `root` with small, varied .txt documents (deterministic)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(40):
        words = " ".join(f"w{(i * 7 + j * 13) % 97}" for j in range(60 + i))
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: {words}\n")
    return root


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    return write_text_corpus(tmp_path / "corpus")


TIMING = ("tokens_per_s", "tflops", "mfu", "peak_mem_gib")
"""metrics.jsonl keys that measure the machine, not the training: left out of comparisons."""


def metrics_records(run_dir: Path, without: tuple[str, ...] = TIMING) -> list[dict]:
    """A run's metrics.jsonl records, each without the keys `without` (its timings)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in without} for line in lines]


def cli_args(overrides: dict[str, str]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in (f"--{key}", value)]


@pytest.fixture
def tiny_args(text_corpus: Path) -> list[str]:
    return cli_args({**TINY_OVERRIDES, "data.path": str(text_corpus)})


def run_cli(args: list[str], timeout: float = 300, launcher: list[str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
    """`python -m moefold ARGS` in a fresh process (what a user runs); `launcher` replaces
    `python -m moefold` (e.g. with torchrun's)."""
    command = launcher or [sys.executable, "-m", "moefold"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, **kwargs)



@pytest.fixture
def durability_events(monkeypatch) -> list[tuple]:
    """What reaches the disk, in order: ("fsync", path) for each os.fsync (the path its file
    descriptor names, as /proc/self/fd resolves it) and ("replace", src, dst) for each os.replace.
    Tests of writes that must survive a power cut read it (a rename flushed before its data)."""
    events, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", Path(src), Path(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return events


@pytest.fixture
def sampled_models(monkeypatch) -> list:
    """The models moefold.generate.sample is called with, in order (it still samples): the model
    `moefold generate` built and loaded, for tests to compare with a reference."""
    import moefold.generate as generate

    models, sample = [], generate.sample

    def recording(model, *args, **kwargs):
        models.append(model)
        return sample(model, *args, **kwargs)
    monkeypatch.setattr(generate, "sample", recording)
    return models


@pytest.fixture
def failing_config_toml_write(monkeypatch):
    """Path.write_text raises EIO for config.toml and its temporary, as a failing disk would; the
    monkeypatch, for `undo()`."""
    write_text = Path.write_text

    def failing(self, *args, **kwargs):
        if self.name.startswith("config.toml"):
            raise OSError(errno.EIO, "Input/output error")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    return monkeypatch


def assert_runs_in_a_fresh_process(script: str) -> None:
    """`python -c SCRIPT` exits 0: for what only a new interpreter shows (modules not yet imported,
    per-process caches not yet filled)."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def run_cli_interrupted(args: list[str], run_dir: Path, signum: int = signal.SIGTERM) -> subprocess.CompletedProcess:
    """`python -m moefold ARGS` sent `signum` once the run's metrics.jsonl holds three records."""
    proc = subprocess.Popen([sys.executable, "-m", "moefold", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def floor_and_held_after_a_step(run_dir: Path, overrides: dict[str, str]) -> tuple[float, int]:
    """(plan/fit.py's floor, the bytes a Trainer's parameters, gradients and optimizer states hold
    after one step of the `tiny` preset with `overrides`), each storage counted once."""
    from moefold.config import load_config
    from moefold.plan.fit import state_bytes_per_parameter
    from moefold.plan.params import model_params
    from moefold.train.trainer import Trainer

    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, run_dir, out=lambda line: None)
    trainer.accumulate_gradients()
    trainer.optimizer.step()
    params = list(trainer.model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return model_params(cfg, trainer.vocab_size).total * state_bytes_per_parameter(cfg), held
