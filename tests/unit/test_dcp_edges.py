"""Checkpoint save and resume at their edges (checkpoint/dcp.py): what one machine saved resumes on
another."""

import json
from pathlib import Path
from unittest import mock

import torch

from moefold.cli import main


def train_losses(run_dir: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_checkpoint_saved_without_cuda_resumes_where_cuda_is_available(tmp_path, tiny_args, capsys):
    """A run saved where CUDA is not available holds no CUDA generator state; resumed on a machine
    with a GPU (here: CUDA made to look available), the trainer asked the load for `rng.cuda` and
    the resume failed with 'checkpoint ... is unreadable or corrupt: Missing key in checkpoint
    state_dict: rng.cuda'. It resumes, with the saved CPU generator, as on the saving machine."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1",
                 "--moe.input_jitter", "0.05"]) == 0  # the jitter draws from the CPU generator
    resume = ["train", "--resume", str(run), "--train.steps", "4", "--checkpoint.save_at_end", "false"]
    assert main([*resume, "--run-dir", str(tmp_path / "here")]) == 0
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.get_rng_state", return_value=cuda_state), \
            mock.patch("torch.cuda.set_rng_state") as set_cuda_state:
        capsys.readouterr()
        code = main([*resume, "--run-dir", str(tmp_path / "gpu-machine")])
    assert code == 0, capsys.readouterr().err
    set_cuda_state.assert_not_called()  # the CUDA generator keeps its seeded state
    assert train_losses(tmp_path / "gpu-machine") == train_losses(tmp_path / "here")
