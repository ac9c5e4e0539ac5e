"""Counts in what the commands print read as English: "1 GPU", "1 step", "1 micro-batch"."""

from moefold.cli import main


def test_plan_memory_says_1_gpu(capsys):
    for gpus, said in (("1", "1 GPU:"), ("2", "2 GPUs:")):
        capsys.readouterr()
        assert main(["plan", "memory", "--config", "tiny", "--gpus", gpus]) == 0
        assert capsys.readouterr().out.splitlines()[0].startswith(f"qwen3_moe, {said} attention pp 1"), gpus


def test_bench_says_1_step_and_1_micro_batch(capsys):
    small = ["--config", "tiny", "--warmup", "0", "--train.micro_batch_size", "2", "--train.seq_len", "32"]
    assert main(["bench", *small, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 × 32 tokens × 1 micro-batch = 64 tokens per step" in out and "(1 step after 0 warm-up)" in out
    assert main(["bench", *small, "--steps", "2", "--train.grad_accum", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 × 32 tokens × 2 micro-batches = 128 tokens" in out and "(2 steps after 0 warm-up)" in out
