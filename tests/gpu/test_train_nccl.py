"""Training through the distributed code path on NCCL with one GPU (torchrun, world size 1: FSDP2,
process groups and DCP all with groups of size 1) gives the one-process run's losses."""

import json
import sys

import pytest
from conftest import run_cli

pytestmark = pytest.mark.gpu

ARGS = ["--config", "tiny-qwen3", "--train.steps", "8", "--train.warmup_steps", "2",
        "--train.micro_batch_size", "4", "--train.seq_len", "64", "--train.val_every", "0",
        "--train.device", "cuda", "--precision.compute_dtype", "fp32", "--logging.log_every", "1",
        "--logging.tensorboard", "false", "--logging.expert_load_heatmap", "false"]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_torchrun_world_one_on_nccl(text_corpus, tmp_path, data_parallel):
    data = ["--data.path", str(text_corpus), "--parallel.data_parallel", data_parallel]
    plain = run_cli(["train", *ARGS, *data, "--run-dir", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr
    launched = run_cli(["train", *ARGS, *data, "--run-dir", str(tmp_path / "torchrun")],
                       launcher=[sys.executable, "-m", "torch.distributed.run",
                                          "--standalone", "--nproc-per-node", "1", "-m", "moefold"])
    assert launched.returncode == 0, launched.stderr
    assert "nccl" in launched.stdout  # the job says which backend it joined
    plain_losses, launched_losses = _losses(tmp_path / "plain"), _losses(tmp_path / "torchrun")
    assert len(plain_losses) == len(launched_losses) == 8
    assert max(abs(a - b) / a for a, b in zip(plain_losses, launched_losses)) < 1e-4
    assert (tmp_path / "torchrun" / "checkpoints").is_dir()
